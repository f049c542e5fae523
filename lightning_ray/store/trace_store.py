"""The TraceStore actor: the rollout queue and every span, in one durable place shared by all workers."""

from __future__ import annotations

from pathlib import Path

import ray

from lightning_ray.store.sqlite import SQLiteBackend
from lightning_ray.types import Rollout, Span, Task, new_id


@ray.remote(num_cpus=0, max_restarts=-1)  # state lives in SQLite: a restart loses nothing
class TraceStore:
    def __init__(self, path: str | Path):
        self.backend = SQLiteBackend(path)

    def enqueue(self, tasks: list[Task]) -> list[str]:
        rollouts = [Rollout(rollout_id=new_id("ro"), task=t) for t in tasks]
        self.backend.add_rollouts(rollouts)
        return [r.rollout_id for r in rollouts]

    def dequeue(self) -> Rollout | None:
        return self.backend.claim_next(lambda rollout_id: new_id("at"))

    def complete(self, rollout_id: str, status: str, reward: float | None = None, error: str | None = None) -> None:
        self.backend.update_rollout(rollout_id, status=status, reward=reward, error=error)

    def add_spans(self, spans: list[Span]) -> int:
        return self.backend.add_spans(spans)

    def get_rollouts(self, rollout_ids: list[str]) -> list[Rollout]:
        return self.backend.get_rollouts(rollout_ids)

    def get_spans(self, rollout_ids: list[str]) -> list[Span]:
        return self.backend.get_spans(rollout_ids)

    def count_spans(self) -> int:
        return self.backend.count_spans()

    def count_finished(self, rollout_ids: list[str]) -> int:
        return sum(r.status in ("succeeded", "failed") for r in self.backend.get_rollouts(rollout_ids))
