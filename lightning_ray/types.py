"""The nouns of the system, shared by every component (names follow the Agent Lightning paper)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

RolloutStatus = Literal["queued", "running", "succeeded", "failed"]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


class Task(BaseModel):
    """One problem for the agent. `group_id` ties the GRPO group of rollouts of the same task together."""

    task_id: str
    input: dict[str, Any]
    group_id: str | None = None


class Rollout(BaseModel):
    """One run of the agent on one task; an attempt is one try of it (retries come with the store, issue 4)."""

    rollout_id: str
    task: Task
    status: RolloutStatus = "queued"
    attempt_id: str | None = None
    reward: float | None = None
    error: str | None = None


class Span(BaseModel):
    """One traced operation: an LLM call (recorded server-side), a tool call, a reward, the rollout itself."""

    span_id: str = Field(default_factory=lambda: new_id("span"))
    rollout_id: str | None = None
    attempt_id: str | None = None
    name: str
    start_time: float = Field(default_factory=time.time)
    end_time: float | None = None
    attributes: dict[str, Any] = Field(default_factory=dict)


class Transition(BaseModel):
    """One policy call turned into RL data: exact token ids from the engine, never re-tokenized."""

    rollout_id: str
    group_id: str
    span_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    reward: float
    advantage: float = 0.0
    policy_version: int
