"""The job's configuration schema: every key, its default and its checks. Hydra composes the YAML in configs/ onto
these defaults (compose.py); pydantic validates it, so a wrong key or value fails before anything starts, with the
key's dotted name in the message (`validate`)."""

from __future__ import annotations

import importlib.metadata
import ipaddress
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from packaging.version import Version
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from lightning_ray.config.secrets import masked
from lightning_ray.placement import results_base

# How token losses add up to the batch loss (the choice changes what a long answer weighs):
#   token_mean     every response token of the batch counts the same (DAPO's token-level mean)
#   sequence_mean  each transition's token mean, then the mean over transitions (the original GRPO)
#   token_sum      the token sum over a constant, transitions × rollout.max_tokens (Dr. GRPO: no length bias)
LossAggregation = Literal["token_mean", "sequence_mean", "token_sum"]
# What one actor (a replica, a worker) takes from a node, in Ray Train's resources_per_worker shape: CPU, GPU and
# custom resources, e.g. {CPU: 1, policy_gpu: 1}. A custom resource steers it to the nodes started with it.
Resources = dict[str, Annotated[float, Field(ge=0)]]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(_Strict):
    name: str = "policy"  # the model name agents ask for; LightningRL trains calls to it (algorithm.select)
    path: str | None = None  # an HF model directory, `smollm2-135m-instruct`, or None: the tiny test model
    # LoRA adapters served on `path` from the start: a checkpoint's adapter/ (one adapter, or one per agent with
    # algorithm.adapters), e.g. to evaluate them (jobs/eval.py); needs learner.lora, whose adapter sync serves them
    adapter: str | None = None
    cache_dir: str = "~/.cache/lightning_ray/models"


def _regex(pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"not a regex: {pattern!r} ({e})") from None
    return pattern


Regex = Annotated[str, AfterValidator(_regex)]  # a string that compiles as a Python regex


def _not_peft_default(name: str) -> str:
    if name == "default":
        raise ValueError("`default` is peft's name for learner.lora's one adapter: name an agent's adapter otherwise")
    if name in "lora_":  # peft finds its adapters' parameters by name: one inside its own prefix would be confused
        raise ValueError(f"{name!r} is part of peft's parameter prefix `lora_`: name the adapter otherwise")
    return name


# algorithm.adapters' names: served as the model `<model.name>/<adapter>` (peft's own adapter is `default`)
AdapterName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"), AfterValidator(_not_peft_default)]


class AIRConfig(_Strict):
    """Automatic intermediate rewards (algorithm/air.py): the reward each runtime signal gives the policy call it
    follows; 0 turns a rule off (all off by default). They reach training through algorithm.credit per_step or
    discounted (terminal credit uses the final reward only)."""

    model_config = ConfigDict(allow_inf_nan=False)  # a NaN or infinite reward would poison every advantage

    tool_ok: float = 0.0  # a tool call that succeeded
    tool_error: float = 0.0  # a tool call that raised
    tool_timeout: float = 0.0  # a tool call that timed out
    malformed_tool_call: float = 0.0  # a <tool_call> block in the answer that could not be parsed
    format_pattern: Regex | None = None  # a regex every policy answer should contain (re.search)
    format_ok: float = 0.0
    format_mismatch: float = 0.0

    @property
    def enabled(self) -> bool:
        return any(v for k, v in self.model_dump().items() if k != "format_pattern")


class TaskConfig(_Strict):
    # a built-in task (lightning_ray/tasks/<name>) or your own: a module "package.module" offering make_tasks and
    # reward, as the built-ins do (docs/03-agents-and-tasks.md, examples/custom_task)
    name: str = Field("calc", pattern=r"^(calc|sql|rag|[A-Za-z_]\w*(\.[A-Za-z_]\w*)+)$")
    # calc: basic_arithmetic (the default) or gsm_symbolic, reasoning-gym's generators; sql: chinook (the default:
    # templated questions) or spider (generator.root: its directory); rag: facts (the default: a generated world)
    # or musique (generator.path: a jsonl file); your task's own names. null: the task's default
    dataset: str | None = Field(None, min_length=1)
    generator: dict[str, Any] = {}  # the generator's options; {}: the task's defaults
    protocol: Literal["text", "tools"] = "text"  # CALC lines in text, or the calculator by OpenAI function calling
    train_size: int = Field(1000, gt=0)
    seed: int = 0  # the training split's seed
    # Draw each batch's tasks evenly over this input field (e.g. sql's family): its values in turn, a task of each,
    # so that a rare kind of task is trained on as often as a common one (sql's held-out split weighs its families
    # alike); the held-out evaluation then reports each value's accuracy. null: uniformly over the training split
    balance: str | None = Field(None, min_length=1)
    eval_size: int = Field(100, gt=0)  # the held-out split: another seed, no question shared with training
    eval_seed: int = 1
    agent_rewards: bool = False  # true: the last reward the agent emitted (a reward span) overrides the task's
    air: AIRConfig = AIRConfig()  # automatic intermediate rewards from tool status and answer format
    # The agent's system prompt, carried to it in each task's input; null: the task's own (tasks/calc.py PROMPTS).
    # E.g. the best prompt jobs/apo.py found, to train or evaluate with it.
    system_prompt: str | None = Field(None, min_length=1)
    # Your own agent instead of the task's (rollout/agents.py): an entry point "package.module:function" called as
    # function(task_input, base_url=..., model=..., api_key=...) -> answer, or a command in any language that reads
    # OPENAI_BASE_URL / OPENAI_API_KEY / OPENAI_MODEL and the task (JSON on stdin) and prints its answer.
    agent: str | None = Field(None, pattern=r"^[\w.]+:[\w.]+$")
    command: list[str] | None = Field(None, min_length=1)
    # A command gets its endpoint, its task and the basics (rollout/agents.py: PATH, HOME, ...) of the worker's
    # environment, not the rest of it (credentials): these names too, e.g. [JAVA_HOME, HTTPS_PROXY]
    agent_env: list[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]] = []
    runtime_env: dict[str, Any] | None = None  # the rollout workers' Ray runtime_env (pip, env_vars, working_dir, ...)

    @field_validator("runtime_env")
    @classmethod
    def _env_vars_as_text(cls, value: dict | None) -> dict | None:
        if value and isinstance(value.get("env_vars"), dict):  # Ray refuses any but strings, once workers start
            value = {**value, "env_vars": {k: _env_text(v) for k, v in value["env_vars"].items()}}
        return value

    @model_validator(mode="after")
    def _one_agent(self):
        if self.agent and self.command:
            raise ValueError("task.agent and task.command both name the agent: set one")
        return self


def _env_text(value: Any) -> Any:
    """An environment variable's value as the command line gave it: Hydra reads OMP_NUM_THREADS=1 as a number."""
    if isinstance(value, bool):
        return str(value).lower()
    return str(value) if isinstance(value, int | float) else value


EnvValue = Annotated[str, BeforeValidator(_env_text)]


class EngineConfig(_Strict):
    kind: Literal["hf", "vllm"] = "hf"
    # auto: bfloat16 on CUDA, float32 on CPUs: bf16 is unusably slow on CPUs without AMX; with AMX, an option (2.3x
    # faster rollouts, learning intact on SmolLM2: docs/01-training.md, benchmarks/results/bf16_cpu.json)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int = Field(1024, gt=0)
    # Share of the GPU's memory the engine may take (vLLM: weights + KV cache; HF: a cap on its allocations). With
    # placement=colocated the learner needs the rest. vLLM-CPU sizes its KV cache by VLLM_CPU_KVCACHE_SPACE instead.
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    tensor_parallel_size: int = Field(1, gt=0)  # GPUs per replica (vLLM); serve.resources.GPU must give them
    prefix_caching: bool = True  # vLLM reuses the KV cache of a rollout's shared prefix (its earlier turns)
    # Calls decoding at once in a replica, the rest queued: the HF engine's batch (64 when unset), vLLM's
    # max_num_seqs (its own default when unset). Bounds the KV cache's memory.
    max_num_seqs: int | None = Field(None, gt=0)
    # Free the engine's GPU memory while the learner trains on the same GPU (placement=colocated): vLLM's sleep mode
    # (weights to host memory, KV cache dropped), the HF engine's weights to the host; the next version loaded
    # wakes it. Serving waits meanwhile. Nothing to free on CPUs.
    sleep_while_training: bool = False
    options: dict[str, Any] = {}  # vLLM's other engine arguments, passed as they are (max_num_seqs, ...)
    env: dict[str, EnvValue] = {}  # environment of the serving replicas (vLLM-CPU's thread binding, ...)

    @model_validator(mode="after")
    def _tensor_parallel_is_vllms(self):
        if self.kind == "hf" and self.tensor_parallel_size > 1:
            raise ValueError("engine.tensor_parallel_size > 1 splits the model over GPUs, which only vLLM does: "
                             "engine=vllm, or tensor_parallel_size=1")
        return self

    @model_validator(mode="after")
    def _one_engine_per_replica(self):
        # A replica holds its GPUs (serve.resources) and is one engine: vLLM's data parallelism would run engines the
        # weight sync never reaches (its NCCL group counts one), its Ray executor would ask Ray for GPUs the replica
        # already holds (waiting up to 30 min), and pipeline stages lack the LM head the weight load re-ties
        for key, fine in (("data_parallel_size", (1,)), ("pipeline_parallel_size", (1,)),
                          ("distributed_executor_backend", ("mp", "uni"))):
            if self.options.get(key) not in (None, *fine):
                raise ValueError(f"engine.options.{key}={self.options[key]}: a replica is one engine on its own "
                                 "GPUs; more replicas (serve.num_replicas) or engine.tensor_parallel_size instead")
        return self

    @model_validator(mode="after")
    def _hf_takes_no_options(self):
        if self.kind == "hf" and self.options:  # else it fails inside a Serve replica, far from the cause
            raise ValueError(f"engine.options {sorted(self.options)}: the hf engine takes none (vLLM's engine "
                             "arguments? engine=hf selects the hf engine without them)")
        return self


def loopback(host: str) -> bool:
    """Whether only this machine reaches `host`: a loopback address or `localhost` (any other name may resolve to
    an interface others reach)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class EmbeddingsConfig(_Strict):
    """POST /v1/embeddings beside the policy (serving/embeddings.py), for agents that embed through the same OpenAI
    base URL they chat through (retrieval, memory), which a 404 would stop. Not the policy: never trained."""
    enabled: bool = True
    # a sentence-transformers model directory (mean or CLS pooling); null: all-MiniLM-L6-v2 from its PyPI package
    path: str | None = None
    # the model names it answers to: the agents' own, unmodified (OpenAI's embedding models, by default)
    names: list[str] = Field(["text-embedding-3-small", "text-embedding-3-large", "text-embedding-ada-002",
                              "all-MiniLM-L6-v2"], min_length=1)


class ServeConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, lt=65536)  # (not 0: agents are given this port, not the one Serve would pick)
    num_replicas: int = Field(1, gt=0)
    autoscaling: dict[str, Any] | None = None  # Serve's autoscaling_config; replaces num_replicas when set

    @field_validator("autoscaling")
    @classmethod
    def _serves_own_keys(cls, value: dict | None) -> dict | None:
        if value:  # Serve ignores a key it does not know (a typo'd max_replicas: one replica)
            from ray.serve.config import AutoscalingConfig

            known = AutoscalingConfig.model_fields if hasattr(AutoscalingConfig, "model_fields") \
                else AutoscalingConfig.__fields__
            if unknown := sorted(set(value) - set(known)):
                raise ValueError(f"unknown key(s) {', '.join(unknown)}: Serve's autoscaling_config takes "
                                 f"{', '.join(sorted(known))}")
            AutoscalingConfig(**value)  # and its values' checks
        return value
    # The operator's key (Authorization: Bearer): it opens every endpoint; agents get keys of their own instead
    # (lightning_ray/auth.py)
    api_key: str | None = Field(None, min_length=1)
    sync_timeout_s: float = Field(120.0, gt=0)
    # What a weight update does with the generations in flight (serving/gate.py): `wait` for them (ending those past
    # drain_timeout_s: 503, "drain_timeout"), `abort` them (503, "weight_update": the client retries), or `keep`
    # them going under the new weights (partial rollouts). null: keep under rollout.mode=async (abort on a vLLM
    # older than 0.32, which cannot keep them), else wait.
    drain: Literal["wait", "abort", "keep"] | None = None
    drain_timeout_s: float = Field(60.0, gt=0)
    # The chat template the server renders with: null (the model's own), `hermes` (ours: ChatML with Hermes
    # <tool_call> tools, for models whose template ignores tools, as SmolLM2's does), or a Jinja file's path.
    chat_template: str | None = None
    resources: Resources = {"CPU": 1}  # each replica's (placement.py); e.g. {CPU: 1, GPU: 1} on a GPU node
    # Serve's limits per replica: calls it takes at once (the engine batches them and queues the rest, in order),
    # and calls waiting in Serve's proxy beyond those (-1: no limit; past it a call is answered 503 at once, which
    # the OpenAI client retries). null: every agent of the run fits (rollout.num_workers x agents_per_worker, at
    # least 256): calls left in the proxy wait while its router polls for room (1,000 agents against a
    # limit of 256 ran at 0.44x the rollouts/s, 1% timed out: docs/13-scale.md)
    max_ongoing_requests: int | None = Field(None, gt=0)
    max_queued_requests: int = Field(-1, ge=-1)
    # Rollout workers send their agents straight to a replica's own HTTP server, skipping Serve's Python proxy
    # (serving/routing.py; Serve's direct ingress, which a local cluster of the run turns on; on a cluster of your
    # own, set routing.DIRECT_INGRESS's variables in its nodes' environment). Clients outside the run use serve.port.
    direct_ingress: bool = True
    embeddings: EmbeddingsConfig = EmbeddingsConfig()

    @model_validator(mode="after")
    def _exposed_only_with_a_key(self):
        if not self.api_key and not loopback(self.host):  # else anyone who reaches it queues, scores, reads tasks
            raise ValueError(f"serve.host={self.host} opens the policy and the store API beyond this machine, and "
                             "serve.api_key is not set: set serve.api_key, or serve.host=127.0.0.1")
        return self


class RolloutConfig(_Strict):
    num_workers: int = Field(2, gt=0)  # RolloutWorker actors
    agents_per_worker: int = Field(16, gt=0)  # agents each runs at once, in threads (the engine batches their calls)
    tasks_per_iteration: int = Field(16, gt=0)
    group_size: int = Field(4, gt=0)  # rollouts per task: one GRPO group
    max_tokens: int = Field(96, gt=0)
    temperature: float = Field(0.7, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    max_attempts: int = Field(1, gt=0)  # tries per rollout; only a platform failure is retried (docs/05-trace-store.md)
    # wall-clock limit of one attempt, enforced by the store and the worker (which leaves a stuck agent behind)
    timeout_seconds: float = Field(600.0, gt=0)  # no null: heartbeats would keep a stuck agent's lease forever
    # a timeout is the policy's doing (scored 0, never retried) or the platform's (no reward, retried, left out)
    timeout_policy: Literal["policy", "platform"] = "policy"
    # agent threads a worker may leave behind at timeouts (still running, still calling the policy) before it is
    # restarted, once its other rollouts have ended: the process takes them with it
    max_abandoned_agents: int = Field(4, gt=0)
    unresponsive_seconds: float | None = Field(60.0, gt=0)  # lease: longest silence between worker heartbeats
    tracing: Literal["embedded", "otel"] = "embedded"  # how the agent's own spans are traced
    # sync: an iteration's rollouts, then its update; async: the next algorithm.max_staleness batches' rollouts run
    # while the learner trains on this one (trainer/schedule.py)
    mode: Literal["sync", "async"] = "sync"
    # each worker's; {}: none, anywhere. A worker reaches the policy through the Serve proxy of its own node, which
    # runs on the head and on nodes holding a replica.
    resources: Resources = {}


class StoreConfig(_Strict):
    num_shards: int = Field(1, gt=0)  # TraceStore actors, each with its own SQLite file; rollouts hash to one
    http: bool = True  # serve the store API and the OTLP receiver at {serve}/store for agents outside Ray
    # spans of the last N iterations are kept (with the evaluations among them), older ones deleted after each
    # iteration: a long run's spans file stops growing; null keeps every span
    keep_iterations: int | None = Field(50, gt=0)


class SelectConfig(_Strict):
    """Which recorded LLM calls are the policy's (algorithm/select.py): regexes, each matched against the whole name.
    A call is kept when its model matches one of `models` and, where `agents` is set, the agent it was made under
    (the nearest enclosing span that names one) matches one of `agents`."""

    models: list[Regex] | None = Field(None, min_length=1)  # null: exactly the served model (model.name)
    agents: list[Regex] | None = Field(None, min_length=1)  # null: any agent, and calls made under none


class AlgorithmConfig(_Strict):
    select: SelectConfig = SelectConfig()  # which calls are trained: by model and by agent name
    # credit assignment and advantages, each option explained in algorithm/advantages.py
    estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "ppo"] = "grpo"
    credit: Literal["terminal", "per_step", "discounted"] = "terminal"
    gamma: float = Field(1.0, ge=0, le=1)  # discount per step (credit: discounted)
    baseline: Literal["group", "turn"] = "group"
    clip_eps: float = Field(0.2, gt=0)  # PPO clip: the ratio is kept within [1 - clip_eps, 1 + clip_eps_high]
    clip_eps_high: float | None = Field(None, gt=0)  # clip-higher (DAPO); null: clip_eps
    # PPO's reuse of a batch: mini_batches optimizer steps (each normalized over itself as loss_aggregation says),
    # the whole repeated ppo_epochs times, all against the logprobs from before the first: the ratio moves, and the
    # clip acts, from the second step on. 1 and 1: one on-policy step (ratio 1). Still one new version per batch.
    ppo_epochs: int = Field(1, gt=0)
    mini_batches: int = Field(1, gt=0)
    overlong_filter: bool = False  # leave out of the loss the calls cut off at max_tokens (DAPO)
    entropy_coef: float = Field(0.0, ge=0)  # entropy bonus in the loss (entropy is reported whatever its value)
    # KL to the frozen initial policy; > 0 keeps a reference copy on every rank (and reports kl_ref)
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k3"] = "k3"
    # where the KL goes: a loss term, or a per-token reward penalty (needs token rewards: estimator ppo)
    kl_penalty: Literal["loss", "reward"] = "loss"
    # PPO's critic (estimator ppo): a value head on the policy's last hidden state, GAE over each call's tokens
    gae_lambda: float = Field(0.95, ge=0, le=1)
    value_coef: float = Field(0.5, gt=0)  # the value loss's weight against the policy loss
    value_lr: float | None = Field(1e-4, gt=0)  # the freshly initialized head learns faster; null: learner.lr
    # truncated importance sampling: each token's gradient weighted by min(π_learner / π_sampler, tis_cap), for
    # samples from an older policy version or an engine whose numerics differ from the learner's; null: off (2 under
    # rollout.mode=async)
    tis_cap: float | None = Field(None, gt=0)
    # rollout.mode=async: how many updates a trained transition's sampler may be behind the learner (and how many
    # batches ahead rollouts run); older transitions are left out, counted
    max_staleness: int = Field(1, ge=1)
    loss_aggregation: LossAggregation = "token_mean"  # how token losses add up (algorithm/loss.py)
    # One sample per policy call, or a rollout's calls merged into one sequence where each prompt extends the last
    # call's context token for token (tool results masked out of the loss): the same gradient, far fewer tokens.
    level: Literal["transition", "trajectory"] = "trajectory"
    # Dynamic sampling (DAPO, algorithm/dynamic_sampling.py): groups without a learning signal are dropped and new
    # tasks rolled out in further rounds, up to max_sampling_rounds, until tasks_per_iteration groups have one.
    dynamic_sampling: bool = False
    max_sampling_rounds: int = Field(3, ge=1)  # rounds per iteration, the first included (dynamic_sampling)
    # rl: the policy gradient on advantages; sft: rejection-sampling fine-tuning, the likelihood of each group's
    # best rollout(s) if they earned at least sft_min_reward (algorithm/advantages.py: best_rollouts)
    objective: Literal["rl", "sft"] = "rl"
    sft_min_reward: float = 1.0
    # An adapter per agent (needs learner.lora): adapter name -> agent-name regexes, matched as select.agents
    # matches. Each selected call is served, and trained, with the adapter its agent maps to (the first that
    # matches), under its own advantages; calls of agents no adapter names are served by the base. null: one
    # adapter for every call (learner.lora alone).
    adapters: dict[AdapterName, list[Regex]] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _options_fit_together(self):
        if self.level == "trajectory" and (self.credit != "terminal" or self.baseline != "group"):
            raise ValueError("algorithm.credit and algorithm.baseline other than terminal / group give each call "
                             "its own advantage: they need algorithm.level=transition")
        if self.kl_coef > 0 and self.kl_penalty == "loss" and self.kl_estimator == "k1":
            raise ValueError("algorithm.kl_estimator=k1 as a loss term has zero expected gradient (that of log π − "
                             "log π_ref on tokens π sampled is ∇log π, which averages to 0): it would not pull "
                             "towards the reference. Use k3, or k1 as a reward penalty (kl_penalty=reward, with ppo)")
        if self.kl_penalty == "reward" and self.estimator != "ppo":
            raise ValueError("algorithm.kl_penalty=reward puts the KL in per-token rewards, which only the critic's "
                             "token-level advantages use: it needs algorithm.estimator=ppo (or kl_penalty=loss)")
        return self

    @model_validator(mode="after")
    def _dynamic_sampling_needs_a_group_baseline(self):
        if self.dynamic_sampling and self.estimator == "ppo":
            raise ValueError("algorithm.dynamic_sampling refills groups whose rollouts scored alike, which have a "
                             "signal under algorithm.estimator=ppo (the value head is the baseline): nothing to refill")
        return self

    @model_validator(mode="after")
    def _sft_uses_final_rewards_only(self):
        unused = [f"algorithm.{k}={getattr(self, k)}" for k, default in
                  (("estimator", "grpo"), ("credit", "terminal"), ("baseline", "group")) if getattr(self, k) != default]
        if self.objective == "sft" and unused:
            raise ValueError(f"{', '.join(unused)}: algorithm.objective=sft picks rollouts by their final reward, "
                             "with no advantage estimator, credit assignment or baseline")
        return self


class TeacherConfig(_Strict):
    """Who answers the training rollouts' calls in an imitation run (jobs/imitate.py: serving/teacher.py); none: the
    policy, as in RL. Its answers are recorded as the policy's tokens and trained on with algorithm.objective=sft."""

    # oracle: the task's (tasks/<name>.py oracle: from the gold data); model: an HF directory (path) loaded beside
    # the policy in each replica; endpoint: an OpenAI-compatible URL (base_url, model, the API key's variable)
    kind: Literal["none", "oracle", "model", "endpoint"] = "none"
    path: str | None = None
    base_url: str | None = None
    model: str | None = None
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")  # read on the replicas
    temperature: float = Field(0.0, ge=0, le=2)  # a model's or an endpoint's sampling
    max_tokens: int = Field(256, gt=0)

    @model_validator(mode="after")
    def _says_where(self):
        needed = {"model": ["path"], "endpoint": ["base_url", "model"]}.get(self.kind, [])
        if missing := [f"teacher.{k}" for k in needed if not getattr(self, k)]:
            raise ValueError(f"teacher.kind={self.kind} needs {' and '.join(missing)}")
        return self


class LoraConfig(_Strict):
    """Low-rank adapters (peft) on a frozen base: only they train and hold optimizer state; the KL reference is the
    base with the adapter off (no second model in memory). No adapter dropout: the learner scores each sampled token
    as the engine sampled it, so every dropout is off."""
    rank: int = Field(16, gt=0)
    alpha: float = Field(32.0, gt=0)  # the update is scaled by alpha / rank
    # the linear layers adapted: names as peft matches them (e.g. [q_proj, v_proj]), or every linear but the LM head
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    # adapt the top N decoder layers only (null: every layer): the backward stops below the lowest adapted one, so
    # an update costs less the fewer the layers (SmolLM2's top 15 of 30: 1.49x), and the adapters learn less
    # (calc: 0.76 held-out against full's 0.97, benchmarks/results/lora_calc_top15.json)
    layers: int | None = Field(None, gt=0)
    # What each version ships to the engines: the adapter alone (a few MB; the engines apply it on their base: peft,
    # vLLM's LoRA kernels) or the merged weights (the whole model, served as a plain one). auto: the adapter where
    # the replicas have GPUs; merged on CPUs, where serving an adapter costs what the sync saves (vLLM-CPU with our
    # LoRA ops: rollouts 1.42x slower, the run no faster: benchmarks/results/lora_calc_adapter_sync_noreread.json).
    sync: Literal["auto", "adapter", "merged"] = "auto"


class TrainerConfig(_Strict):
    """The RL loop (lightning_ray/trainer): how long it runs, when it evaluates and checkpoints."""
    iterations: int = Field(8, gt=0)
    # training minutes, counted after the evaluation before training; the iteration running when they run out is
    # the last
    max_minutes: float | None = Field(None, gt=0)
    eval_every: int = Field(4, ge=0)  # held-out evaluation before training, every N iterations and at the end; 0: none
    eval_before: bool = True  # false: none before training (the start's accuracy is known: a second run from it)
    # the policy, optimizer state and loop state (what resume=<run_dir> goes on from), and after the last iteration
    checkpoint_every: int = Field(4, gt=0)
    keep_checkpoints: int = Field(1, gt=0)  # the last N checkpoints stay (each holds the optimizer state too)
    # each metrics.jsonl line's numbers as TensorBoard scalars in <run_dir>/tensorboard (`tensorboard --logdir runs`)
    tensorboard: bool = True

    @model_validator(mode="before")
    @classmethod
    def _learner_keys_moved(cls, data):
        if isinstance(data, dict) and (moved := [k for k in data if k in LearnerConfig.model_fields]):
            raise ValueError(moved_to_learner(moved))
        return data


class LearnerConfig(_Strict):
    """The learner (lightning_ray/learner): its Ray Train ranks, DeepSpeed, the optimizer, how weights reach the
    engines."""
    num_workers: int = Field(1, gt=0)  # Ray Train workers (DeepSpeed data-parallel ranks)
    threads_per_worker: int = Field(2, gt=0)  # torch threads in each: workers × threads ≈ the cores to train on
    micro_batch_tokens: int = Field(2048, gt=0)  # padded tokens per forward/backward: bounds the memory
    # auto: 0 for one fp32 worker (nothing to partition), 1 for one bf16 worker (a ZeRO optimizer keeps the fp32
    # master weights), 2 for more or with offload_optimizer (learner/driver.py zero_stage)
    zero_stage: Literal["auto", 0, 1, 2, 3] = "auto"
    # The learner's compute dtype. bfloat16: DeepSpeed's bf16 mode, fp32 master weights and optimizer state; auto:
    # bfloat16 on CUDA, float32 on CPUs (bf16 matmuls without AMX ran ~10x slower than fp32; with AMX a step ran 2x
    # faster, but its weights start on bf16's grid, so small updates move what it serves less: make train 0.80
    # against 0.98, benchmarks/results/bf16_cpu.json; LoRA's frozen base loses nothing to it: docs/01-training.md)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # Recompute each layer's activations in backward instead of keeping them: memory for ~30% more compute;
    # auto: on with CUDA (long sequences, big batches), off on CPUs (small models, compute-bound)
    gradient_checkpointing: Literal["auto", True, False] = "auto"
    # A micro-batch's rows that open alike (an agent's system prompt and context, a group's one prompt) run their
    # common prefix through the model once, its keys and values shared by every row: the same logprobs and
    # gradients for a fraction of the work where prompts are long; rows sorted by prompt so alike ones share a
    # micro-batch, which holds more rows (the prefix counts once in micro_batch_tokens; its keys and values are
    # held per row). Off with gradient checkpointing, which drops a layer's given cache in transformers.
    shared_prefix: bool = True
    # The learner's attention kernel; auto: sdpa (PyTorch's fused attention), but eager in bf16 on CPUs, where sdpa's
    # flash-attention backward sets up a small oneDNN GEMM per block, each allocating under one malloc arena
    # (placement=cpu's learner.env): a step took 1.8x eager's (benchmarks/results/update_speed_bf16_cpu.json)
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"
    # ZeRO-Offload: optimizer state and step on the host, for a model whose Adam state does not fit the GPU
    # (needs zero_stage 1-3; DeepSpeed's CPU Adam compiles once, ~1 min)
    offload_optimizer: bool = False
    lr: float = Field(2e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    step_timeout_s: float = Field(900.0, gt=0)  # for one step or save, a restart of the ranks included
    # Ray Train restarts the ranks when one's process dies (FailureConfig.max_failures), at most this often in a run:
    # they go on from the latest checkpoint (learner/driver.py). An error raised in a rank fails the run at once.
    max_restarts: int = Field(3, ge=0)
    # The first step fails, before any update, where the learner's logprobs of the sampled tokens (at the calls'
    # temperatures; calls drawn within a top_p nucleus or a grammar left out) are further than this from the
    # server's, per token on average (metrics' logprob_abs_diff: ~1e-7 at fp32 on CPUs; bf16 on a GPU not measured
    # here): the two would not compute the same policy (another model or revision, chat template, dtype, logit
    # processing). null: no check
    max_logprob_gap: float | None = Field(0.1, gt=0)
    # each Ray Train worker's resources, and how its placement group spreads the workers over nodes
    resources_per_worker: Resources = {"CPU": 1}
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    # How new weights reach the engines (lightning_ray/weight_sync); auto: object_store unless the learner and the
    # replicas have GPUs, then cuda_ipc where they share one (fractional GPUs on both), else collective (NCCL)
    weight_sync: Literal["auto", "object_store", "cuda_ipc", "collective"] = "auto"
    lora: LoraConfig | None = None  # null: full fine-tuning; learner.lora={} (or {rank:8,...}): LoRA adapters
    env: dict[str, EnvValue] = {}  # environment of the ranks' processes (configs/placement/cpu.yaml: glibc's malloc)

    @model_validator(mode="after")
    def _zero_stage_fits(self):
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("learner.offload_optimizer moves ZeRO's optimizer partitions to the host: it needs "
                             "learner.zero_stage 1, 2 or 3 (or auto, which then picks 2)")
        if self.dtype == "bfloat16" and self.zero_stage == 0:
            raise ValueError("learner.dtype=bfloat16 with learner.zero_stage=0 would step the bf16 weights with no "
                             "fp32 master copy: zero_stage 1 (one rank: nothing partitioned) or auto")
        return self


def as_recorded_today(data: dict) -> dict:
    """A config.yaml a run wrote, with today's keys: one recorded before the learner had its own keys holds them
    under trainer.* (a record is read as it was written; only new configs are refused for the old names)."""
    trainer = dict(data.get("trainer") or {})
    moved = {k: trainer.pop(k) for k in list(trainer) if k in LearnerConfig.model_fields}
    return {**data, "trainer": trainer, "learner": {**moved, **(data.get("learner") or {})}} if moved else data


def moved_to_learner(keys: list[str]) -> str:
    """The message for keys of the learner given under trainer.*, where they were before the learner had its own."""
    return (", ".join(f"trainer.{k} is now learner.{k}" for k in keys) +
            " (trainer.* holds the RL loop's settings, learner.* the learner's)")


class EvalConfig(_Strict):
    pass_k: int = Field(0, ge=0)  # besides greedy accuracy, k samples per held-out task at rollout.temperature


class RayConfig(_Strict):
    address: str | None = None  # None starts a local cluster; "auto" joins the one `ray job submit` runs on
    num_cpus: int | None = Field(4, gt=0)  # a local cluster's logical CPUs: phases alternate, so they may exceed cores
    metrics_export_port: int | None = Field(None, ge=1, le=65535)  # a local cluster's Prometheus port; None: any free


MIN_ONGOING_REQUESTS = 256  # serve.max_ongoing_requests unless set: agents outside the run (jobs/serve.py) need room
ASYNC_TIS_CAP = 2.0  # algorithm.tis_cap unless set, where samples may be older (rollout.mode=async, serve.drain=keep)


def installed_vllm() -> str | None:
    """The installed vLLM's version (the CUDA or the CPU build), without importing it (seconds)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def default_drain(mode: str, engine: str, vllm: str | None) -> str:
    """serve.drain unless set: under rollout.mode=async an update lands while the next batches generate, so none
    waits for them: `keep` them going where the engine labels each token with its weights' version (the HF engine;
    vLLM 0.32, not 0.25, the vLLM for torch 2.11: serving/engines/vllm.py), else `abort` them (the clients retry)."""
    if mode != "async":
        return "wait"
    return "abort" if engine == "vllm" and vllm and Version(vllm).release[:2] < (0, 32) else "keep"


RESUME_AUTO = "auto"  # resume= naming no directory: run_dir's own checkpoint, if any


class TrainConfig(_Strict):
    run_dir: str  # relative: to the directory the job started in (placement.results_base)
    run_root: str = "runs"  # where run directories go (configs/train.yaml: run_dir is run_root/<time>)
    seed: int = 0
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    engine: EngineConfig = EngineConfig()
    serve: ServeConfig = ServeConfig()
    store: StoreConfig = StoreConfig()
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    trainer: TrainerConfig = TrainerConfig()
    learner: LearnerConfig = LearnerConfig()
    eval: EvalConfig = EvalConfig()
    teacher: TeacherConfig = TeacherConfig()
    ray: RayConfig = RayConfig()
    verbose: bool = False  # Ray's, Serve's and the libraries' logs on the terminal too, not only in <run_dir>/logs
    # A run directory to go on with from its latest checkpoint, with the same config (it becomes run_dir); or auto:
    # run_dir's own, if it holds one (else a new run there), so a job retried after its driver died goes on by itself
    resume: str | None = None

    @model_validator(mode="after")
    def _async_corrects_for_staleness(self):
        if self.serve.drain is None:
            self.serve.drain = default_drain(self.rollout.mode, self.engine.kind, installed_vllm())
        if self.rollout.mode == "async" and self.engine.sleep_while_training:
            raise ValueError("rollout.mode=async runs rollouts while the learner trains, and "
                             "engine.sleep_while_training puts the engines to sleep then: choose one")
        # samples from older versions (async), or calls partly sampled by one (keep): weighed against their sampler
        if (self.rollout.mode == "async" or self.serve.drain == "keep") and self.algorithm.tis_cap is None:
            self.algorithm.tis_cap = ASYNC_TIS_CAP
        return self

    @model_validator(mode="after")
    def _every_agent_fits_a_replica(self):
        if self.serve.max_ongoing_requests is None:
            self.serve.max_ongoing_requests = max(MIN_ONGOING_REQUESTS,
                                                  self.rollout.num_workers * self.rollout.agents_per_worker)
        return self

    @model_validator(mode="after")
    def _teacher_is_imitated(self):
        if self.teacher.kind != "none" and self.algorithm.objective != "sft":
            raise ValueError(f"teacher.kind={self.teacher.kind} answers the training rollouts: imitation data, which "
                             "only algorithm.objective=sft trains on (algorithm=sft; jobs/imitate.py sets it)")
        return self

    @model_validator(mode="after")
    def _rl_has_a_signal(self):
        """What would train nothing, said at the start (jobs that train: not APO's)."""
        alg = self.algorithm
        if alg.objective != "rl":
            return self
        if self.rollout.group_size < 2 and alg.estimator != "ppo":
            raise ValueError(f"rollout.group_size=1: algorithm.estimator={alg.estimator} compares each rollout with "
                             "the others of its task, so every advantage would be 0 and nothing would train: "
                             "rollout.group_size>=2, or algorithm.estimator=ppo (a critic's baseline)")
        if self.task.air.enabled and alg.credit == "terminal":
            raise ValueError("task.air's rewards are intermediate ones, which algorithm.credit=terminal leaves out (it "
                             "trains on the final reward alone): set algorithm.credit=per_step or discounted, with "
                             "algorithm.level=transition")
        return self

    @model_validator(mode="after")
    def _adapters_are_lora(self):
        for key, value in (("algorithm.adapters", self.algorithm.adapters), ("model.adapter", self.model.adapter)):
            if value and not self.learner.lora:
                raise ValueError(f"{key} is LoRA's: it needs learner.lora (learner.lora={{}} for the defaults)")
            if value and self.learner.lora.sync == "merged":
                raise ValueError(f"{key} serves adapters on one base: learner.lora.sync=merged would publish one "
                                 "merged model; use adapter (or auto)")
        return self

    @model_validator(mode="after")
    def _a_replica_has_its_engines_gpus(self):
        tp, gpus = self.engine.tensor_parallel_size, self.serve.resources.get("GPU", 0)
        if tp > 1 and 0 < gpus < tp:  # else vLLM refuses only once the replica starts (on CPUs: CPU workers)
            raise ValueError(f"engine.tensor_parallel_size={tp} splits the model over {tp} GPUs per replica: "
                             f"serve.resources.GPU={gpus} must give them (serve.resources.GPU={tp})")
        return self

    @model_validator(mode="after")
    def _weight_sync_fits_the_devices(self):
        from lightning_ray import weight_sync

        # raises where the transport cannot join the learner's device to the replicas'
        if weight_sync.of_run(self) == "cuda_ipc":  # rank 0's handles open on its own GPU only
            s, replicas = self.serve, (self.serve.autoscaling or {}).get("max_replicas", self.serve.num_replicas)
            others = [f"{key}={value}" for key, value in (("learner.num_workers", self.learner.num_workers),
                                                          ("engine.tensor_parallel_size",
                                                           self.engine.tensor_parallel_size)) if value > 1]
            if s.resources["GPU"] * replicas + self.learner.resources_per_worker["GPU"] > 1 + 1e-6:
                others.append(f"serve.resources.GPU={s.resources['GPU']} x {replicas} replicas (serve.num_replicas"
                              f"{', serve.autoscaling' if s.autoscaling else ''}) beside the learner's share")
            if others:
                raise ValueError(f"learner.weight_sync=cuda_ipc (placement=colocated) shares one GPU between the "
                                 f"learner's rank 0 and the engine: {', '.join(others)} puts ranks, engine "
                                 "workers or replicas on other GPUs, which it cannot reach; placement=split "
                                 "(collective)")
        return self

    @model_validator(mode="after")
    def _resume_in_place(self):
        if self.resume and not self.resume_auto:
            self.run_dir = self.resume
        return self

    @property
    def resume_auto(self) -> bool:
        """resume=auto: go on from run_dir's own checkpoint if it has one, else start a new run there."""
        return self.resume == RESUME_AUTO

    @property
    def run_path(self) -> Path:
        return (results_base() / Path(self.run_dir).expanduser()).resolve()  # an absolute run_dir wins

    def save(self, path: Path) -> None:
        """The config as the run resolved it, secrets masked: the run directory's record of how it was made."""
        data = {**self.model_dump(mode="json"), "run_dir": str(self.run_path)}
        path.write_text(yaml.safe_dump(masked(data), sort_keys=False))



class APOConfig(_Strict):
    """Automatic prompt optimization (algorithm/apo.py): the policy critiques and rewrites the task's system prompt;
    a rewrite is kept only when it scores higher on the validation split than the prompt it would replace."""

    rounds: int = Field(2, gt=0)  # critique → rewrite → measure → keep the best, this many times
    beam: int = Field(4, gt=0)  # rewrites of the incumbent per round (one request, n=beam)
    val_size: int = Field(32, gt=0)  # the validation split (the first of the training split): selection only
    failures: int = Field(4, gt=0)  # the incumbent's worst-scored validation rollouts shown to the critic
    temperature: float = Field(0.8, ge=0, le=2)  # the critic's and the editor's sampling (measurements are greedy)
    critique_max_tokens: int = Field(128, gt=0)
    edit_max_tokens: int = Field(128, gt=0)
    max_prompt_chars: int = Field(600, gt=0)  # a rewrite longer than this is cut at a word boundary
    reply_chars: int = Field(160, gt=0)  # each of a failure's policy replies, clipped to this in the critic's prompt


class APOJobConfig(TrainConfig):
    """jobs/apo.py's configuration: the main job's keys (the same services run the rollouts) and apo.*."""

    apo: APOConfig = APOConfig()

    def _rl_has_a_signal(self):  # no RL here: the rollouts score prompts (a group of one, AIR's spans, as asked)
        return self


class ConfigError(ValueError):
    """A config key with a bad value; the message names each offending key."""

def validate(raw: dict, schema: type[TrainConfig] = TrainConfig) -> TrainConfig:
    try:
        return schema.model_validate(raw)
    except ValidationError as e:
        lines = [f"  {'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
        raise ConfigError("invalid config:\n" + "\n".join(lines)) from None
