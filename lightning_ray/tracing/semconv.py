"""Span names and attribute keys. LLM attributes follow the OpenTelemetry GenAI semantic conventions.

`gen_ai.*` keys are used as OpenTelemetry defines them: spans from any GenAI-instrumented framework already speak
our vocabulary. `lightning_ray.*` keys are ours: what RL needs and the conventions do not carry."""

# Span names.
LLM_CALL = "llm.call"
REWARD = "reward"
ROLLOUT = "rollout"
MESSAGE = "message"
OBJECT = "object"
EXCEPTION = "exception"  # also the name of OpenTelemetry's exception event
EMBEDDINGS = "embeddings"  # a call to the policy server's embedding model (serving/embeddings.py): never trained

# Attribution: which rollout and attempt a span belongs to (span attribute, else resource attribute).
ROLLOUT_ID = "lightning_ray.rollout_id"
ATTEMPT_ID = "lightning_ray.attempt_id"

# LLM calls (recorded server-side).
MODEL = "gen_ai.request.model"
PROMPT_TOKEN_IDS = "lightning_ray.prompt_token_ids"
COMPLETION_TOKEN_IDS = "lightning_ray.completion_token_ids"
LOGPROBS = "lightning_ray.logprobs"
POLICY_VERSION = "lightning_ray.policy_version"  # the oldest version that produced any of the call's tokens
# [[version, start, end), ...]: which completion tokens each version produced (more than one: a weight update landed
# mid-generation, serve.drain=keep)
POLICY_VERSION_SPANS = "lightning_ray.policy_version_spans"
SAMPLING = "lightning_ray.sampling"  # {temperature, top_p, seed, constrained}: the distribution tokens came from
FINISH_REASONS = "gen_ai.response.finish_reasons"
RESPONSE_TEXT = "lightning_ray.response"  # the text the client was sent
CALL_ERROR = "lightning_ray.error"  # why a call ended without an answer (an engine error, an abort): never trained
ADAPTER = "lightning_ray.adapter"  # the LoRA adapter that served the call (serving/adapters.py); none: the base
TEACHER = "lightning_ray.teacher"  # the teacher that answered the call (serving/teacher.py): imitation data, never RL

# Rewards: REWARD_VALUE is the scalar LightningRL optimises; a multi-dimensional reward also carries each named
# dimension as f"{REWARD_VALUE}.{name}".
REWARD_VALUE = "lightning_ray.reward"
# The span id of the policy call an intermediate reward is for (AIR's); a reward without one is credited by time, to
# the last call that started before it.
REWARD_CALL = "lightning_ray.reward.call"
# On the reward span the runner records with the task's own reward (rollout/runner.py): not one the agent emitted
REWARD_TASK = "lightning_ray.reward.task"

# emit_message / emit_object payloads.
MESSAGE_TEXT = "lightning_ray.message"
OBJECT_JSON = "lightning_ray.object"  # the object as JSON text

# GenAI agents and tools. A tool span's status (ok/error) is the runtime signal AIR turns into a reward.
AGENT_NAME = "gen_ai.agent.name"
AGENT_ID = "gen_ai.agent.id"
OPERATION = "gen_ai.operation.name"
EXECUTE_TOOL = "execute_tool"  # the OPERATION of a tool call; its span is named f"execute_tool {tool name}"
TOOL_NAME = "gen_ai.tool.name"
TOOL_CALL_ID = "gen_ai.tool.call.id"
TOOL_CALL_ARGUMENTS = "gen_ai.tool.call.arguments"
TOOL_CALL_RESULT = "gen_ai.tool.call.result"
ERROR_TYPE = "error.type"
ERROR_TYPE_OTHER = "_OTHER"  # error.type when the error has no type (a plain message)

# OpenTelemetry's exception event.
EXCEPTION_TYPE = "exception.type"
EXCEPTION_MESSAGE = "exception.message"
EXCEPTION_STACKTRACE = "exception.stacktrace"
EXCEPTION_ESCAPED = "exception.escaped"

# Keys other instrumentations use for exactly what GenAI calls gen_ai.agent.name (OpenInference; Pydantic AI).
AGENT_NAME_ALIASES = ("agent.name", "agent_name")
# The HTTP header naming the agent a request was made under (tracing/agent_header.py; serving/adapters.py)
AGENT_HEADER = "x-lightning-ray-agent"

# Resource attributes copied onto each span (a Span has no resource of its own): who produced it.
SERVICE_NAME = "service.name"
RESOURCE_KEYS = (SERVICE_NAME, "service.namespace", AGENT_NAME, AGENT_ID)
