"""The nouns of the system, shared by every component (names follow the Agent Lightning paper)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

# A rollout waits in the queue, runs as one or more attempts, and ends once. A failed attempt with attempts left
# sends it back as "requeued" (never straight from running to queued: the history stays readable).
RolloutStatus = Literal["queued", "running", "requeued", "succeeded", "failed", "cancelled"]
AttemptStatus = Literal["running", "succeeded", "failed", "timeout", "unresponsive"]
FINISHED: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})
CancelOutcome = Literal["cancelled", "already_ended", "unknown"]  # what cancelling did to one rollout


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


class Task(BaseModel):
    """One problem for the agent. `group_id` ties the GRPO group of rollouts of the same task together.
    `sampling`: defaults the policy server applies to this rollout's calls where the agent's request leaves them
    unset (evaluation decodes greedily with {"temperature": 0} whatever the training temperature is)."""

    task_id: str
    input: dict[str, Any]
    group_id: str | None = None
    sampling: dict[str, Any] = Field(default_factory=dict)


class RolloutConfig(BaseModel):
    """How long an attempt may take and when the store retries it."""

    max_attempts: int = Field(1, ge=1)
    timeout_seconds: float | None = Field(None, gt=0)  # wall-clock limit of one attempt
    unresponsive_seconds: float | None = Field(None, gt=0)  # longest silence between heartbeats (the lease)
    retry_on: list[AttemptStatus] = ["failed", "timeout", "unresponsive"]


class Rollout(BaseModel):
    """One run of the agent on one task. `attempt_id` is its latest attempt (one try of it)."""

    rollout_id: str
    task: Task
    status: RolloutStatus = "queued"
    config: RolloutConfig = Field(default_factory=RolloutConfig)
    attempt_id: str | None = None
    attempts: int = 0
    reward: float | None = None
    error: str | None = None
    enqueued_at: float = Field(default_factory=time.time)
    ended_at: float | None = None


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


class SpanEvent(BaseModel):
    name: str
    time: float
    attributes: dict[str, Any] = Field(default_factory=dict)


class Span(BaseModel):
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


class Transition(BaseModel):
    """One policy call turned into RL data: exact token ids from the engine, never re-tokenized. `temperature` is
    the one the call was sampled at: the learner scores the tokens under the same distribution."""

    rollout_id: str
    group_id: str
    span_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    reward: float  # the episode's final reward
    step: int = 0  # which of the rollout's policy calls (0, 1, ...)
    step_reward: float = 0.0  # intermediate rewards credited to this call (recorded after it, before the next)
    finish_reason: str | None = None  # "length": cut off at max_tokens
    returns: float = 0.0  # G_t, what credit assignment gave this call (algorithm/advantages.py)
    advantage: float = 0.0  # with a critic (ppo) the learner computes one per token instead
    policy_version: int
    temperature: float = 1.0
    # Trajectory level (several calls merged into one sequence): 1 for the policy's response tokens, 0 for the
    # tool results and user turns between them, which are context, not actions. None: every response token is.
    loss_mask: list[int] | None = None

    @property
    def action_mask(self) -> list[int]:
        return self.loss_mask if self.loss_mask is not None else [1] * len(self.response_ids)

    @property
    def action_tokens(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else len(self.response_ids)
