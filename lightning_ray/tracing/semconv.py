"""Span names and attribute keys. LLM attributes follow the OpenTelemetry GenAI semantic conventions."""

LLM_CALL = "llm.call"
REWARD = "reward"
ROLLOUT = "rollout"

MODEL = "gen_ai.request.model"
PROMPT_TOKEN_IDS = "lightning_ray.prompt_token_ids"
COMPLETION_TOKEN_IDS = "lightning_ray.completion_token_ids"
LOGPROBS = "lightning_ray.logprobs"
POLICY_VERSION = "lightning_ray.policy_version"
REWARD_VALUE = "lightning_ray.reward"
