"""The nouns of the system, shared by every component (names follow the Agent Lightning paper)."""

from __future__ import annotations

import os
import time
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, Field, PlainSerializer, PlainValidator, field_serializer, model_validator

# A rollout waits in the queue, runs as one or more attempts, and ends once. A failed attempt with attempts left
# sends it back as "requeued" (never straight from running to queued: the history stays readable).
RolloutStatus = Literal["queued", "running", "requeued", "succeeded", "failed", "cancelled"]
AttemptStatus = Literal["running", "succeeded", "failed", "timeout", "unresponsive"]
FINISHED: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})
CancelOutcome = Literal["cancelled", "already_ended", "unknown"]  # what cancelling did to one rollout


def new_id(prefix: str) -> str:
    return f"{prefix}-{os.urandom(8).hex()}"  # 64 random bits, as uuid4().hex[:16] gave, without the UUID


class Task(BaseModel):
    """One problem for the agent. `input` is what the agent gets; `reference` what only the reward function reads
    besides it (the expected answer, a gold query): never handed to the agent. `group_id` ties the GRPO group of
    rollouts of the same task together. `sampling`: defaults the policy server applies to this rollout's calls where
    the agent's request leaves them unset (evaluation decodes greedily with {"temperature": 0} whatever the training
    temperature is)."""

    task_id: str
    input: dict[str, Any]
    reference: dict[str, Any] = Field(default_factory=dict)
    group_id: str | None = None
    sampling: dict[str, Any] = Field(default_factory=dict)

    @property
    def reward_input(self) -> dict[str, Any]:
        """What the task's reward function is given: the input and the reference."""
        return {**self.input, **self.reference}


class AttemptPolicy(BaseModel):
    """How long an attempt may take and when the store retries it."""

    max_attempts: int = Field(1, ge=1)
    # wall-clock limit of one attempt: every rollout has one, or heartbeats would keep a stuck agent's lease forever
    timeout_seconds: float = Field(600.0, gt=0)
    unresponsive_seconds: float | None = Field(None, gt=0)  # longest silence between heartbeats (the lease)
    # Which endings retry. Only a platform failure is retried (one without a reward: endpoint down, a lost lease):
    # a failure the policy caused is scored and final, or retries would replace its 0 by a luckier try.
    retry_on: list[AttemptStatus] = ["failed", "timeout", "unresponsive"]
    # A timeout is the policy's (an answer that loops or never ends: scored 0, not retried) or the platform's (a
    # slow endpoint: no reward, retried, left out of training).
    timeout_policy: Literal["policy", "platform"] = "policy"


QueueName = Annotated[str, Field(min_length=1, max_length=256)]  # a rollout's queue (Rollout.queue)


class Rollout(BaseModel):
    """One run of the agent on one task. `attempt_id` is its latest attempt (one try of it)."""

    rollout_id: str
    task: Task
    status: RolloutStatus = "queued"
    config: AttemptPolicy = Field(default_factory=AttemptPolicy)
    attempt_id: str | None = None
    attempts: int = 0
    reward: float | None = None
    error: str | None = None
    enqueued_at: float = Field(default_factory=time.time)
    ended_at: float | None = None
    # only workers that dequeue from this queue take it: a training run's own workers take its rollouts only, and
    # rollouts enqueued over the store API (queue "default" unless named) go to the workers that ask for them
    queue: QueueName = "default"


class Attempt(BaseModel):
    """One try of a rollout by one worker, kept alive by heartbeats."""

    attempt_id: str
    rollout_id: str
    sequence: int  # 1 for the first try
    status: AttemptStatus = "running"
    worker_id: str | None = None
    started_at: float = Field(default_factory=time.time)
    last_heartbeat: float = Field(default_factory=time.time)
    ended_at: float | None = None
    error: str | None = None


class Verdict(BaseModel):
    """A worker's end of one attempt, as `finish_attempt` takes it (a batch of them: `finish_attempts`)."""

    rollout_id: str
    attempt_id: str
    status: AttemptStatus
    reward: float | None = None
    error: str | None = None


class ArrayModel(BaseModel):
    """A model whose fields may hold numpy arrays (token ids, logprobs): equal field by field, an array to an array
    or a list of the same numbers (pydantic's own == would ask an array for its truth value, and fail)."""

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(_same(getattr(self, k), getattr(other, k)) for k in type(self).model_fields)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(v, b[k]) for k, v in a.items())
    return a == b


class SpanEvent(BaseModel):
    name: str
    time: float
    attributes: dict[str, Any] = Field(default_factory=dict)


class Span(ArrayModel):
    """One traced operation: an LLM call (recorded server-side), a tool call, a reward, the rollout itself.

    The same shape whether it came from the embedded tracer, our OpenTelemetry exporter or the OTLP receiver."""

    span_id: str = Field(default_factory=lambda: new_id("span"))
    trace_id: str | None = None
    parent_id: str | None = None
    rollout_id: str | None = None
    attempt_id: str | None = None
    name: str
    start_time: float = Field(default_factory=time.time)
    end_time: float | None = None
    status: Literal["unset", "ok", "error"] = "unset"
    status_message: str | None = None
    attributes: dict[str, Any] = Field(default_factory=dict)
    events: list[SpanEvent] = Field(default_factory=list)
    # Who stored it, set by the store from the path the span came in by (a sender's value is ignored): "server"
    # for the policy server's LLM calls, the only spans training data is made of; "client" for everything else.
    origin: Literal["server", "client"] = "client"

    @field_serializer("attributes", when_used="json")
    def _arrays_as_lists(self, attributes: dict[str, Any]) -> dict[str, Any]:
        """Token ids and logprobs read from the store are numpy arrays (store/rows.py); JSON shows them as lists."""
        return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in attributes.items()}


def _flat_array(dtype: type, kinds: str) -> Any:
    """A 1-d numpy array field. An array of `dtype` is taken as it is (a view into the store's bytes: no copy, no
    per-element check, which for lists of ~500k numbers was most of the adapter's time); a list or an array of
    another numeric kind among `kinds` is converted once, exactly (an int out of range is an error). JSON: a list."""
    dtype = np.dtype(dtype)

    def convert(value: Any) -> np.ndarray:
        a = np.asarray(value)
        if a.dtype == dtype and a.ndim == 1:
            return a
        if a.ndim != 1 or (a.size and a.dtype.kind not in kinds):
            raise ValueError(f"must be a flat list of {dtype.name} numbers")
        out = a.astype(dtype)
        if a.dtype.kind in "iu" and not np.array_equal(out, a):
            raise ValueError(f"values out of the range of {dtype.name}")
        return out

    return Annotated[np.ndarray, PlainValidator(convert), PlainSerializer(np.ndarray.tolist, when_used="json")]


TokenIds = _flat_array(np.int32, "iu")  # every tokenizer's vocabulary fits
Logprobs = _flat_array(np.float64, "iuf")  # as the engine reports them, bit for bit
Mask = _flat_array(np.int8, "biu")


class Transition(ArrayModel):
    """One policy call turned into RL data: exact token ids from the engine, never re-tokenized. `temperature` is
    the one the call was sampled at: the learner scores the tokens under the same distribution. Token ids, logprobs
    and the loss mask are numpy arrays (lists given are converted): they stay as packed as the store keeps them, and
    Ray ships them without pickling each number."""

    rollout_id: str
    group_id: str
    span_id: str
    prompt_ids: TokenIds
    response_ids: TokenIds
    logprobs: Logprobs
    reward: float  # the episode's final reward
    step: int = 0  # which of the rollout's policy calls (0, 1, ...)
    step_reward: float = 0.0  # intermediate rewards credited to this call (recorded after it, before the next)
    finish_reason: str | None = None  # "length": cut off at max_tokens
    returns: float = 0.0  # G_t, what credit assignment gave this call (algorithm/advantages.py)
    advantage: float = 0.0  # with a critic (ppo) the learner computes one per token instead
    policy_version: int
    temperature: float = 1.0
    # Scored by the learner at this temperature instead (algorithm.objective=sft: 1, the model's own likelihood). The
    # served logprobs, drawn at `temperature`, are then not the learner's to match nor to importance-weight by
    score_temperature: float | None = None
    # < 1: drawn within a nucleus, so its logprobs are renormalized there, higher than the learner's over the whole
    # vocabulary (compared with the learner's on full-vocabulary calls only; importance-weighted as they are)
    top_p: float = 1.0
    # Trajectory level (several calls merged into one sequence): 1 for the policy's response tokens, 0 for the
    # tool results and user turns between them, which are context, not actions. None: every response token is.
    loss_mask: Mask | None = None
    # Trajectory level: the action tokens of each merged call, in order, so the loss weighs each call as it would
    # weigh it alone (algorithm/loss.py token_weights). None: one call.
    call_tokens: list[int] | None = None
    # The LoRA adapter that served the call, which trains on it (algorithm.adapters); None: the base, or learner.lora's
    # one adapter
    adapter: str | None = None
    # Sampled under a grammar's mask (a JSON response format, a required tool call): its logprobs are the masked
    # distribution's, which the learner's softmax over the whole vocabulary does not reproduce (the learner neither
    # compares them with its own nor importance-weights by them), and a token the grammar alone allowed (logprob 0)
    # was no choice of the policy's (out of loss_mask)
    constrained: bool = False

    @model_validator(mode="after")
    def _one_logprob_per_response_token(self) -> Transition:
        for name in ("logprobs", "loss_mask"):
            if (a := getattr(self, name)) is not None and len(a) != len(self.response_ids):
                raise ValueError(f"{name} has {len(a)} entries for {len(self.response_ids)} response tokens")
        return self

    @property
    def action_mask(self) -> np.ndarray:
        return self.loss_mask if self.loss_mask is not None else np.ones(len(self.response_ids), np.int8)

    @property
    def action_tokens(self) -> int:
        return int(self.loss_mask.sum()) if self.loss_mask is not None else len(self.response_ids)
