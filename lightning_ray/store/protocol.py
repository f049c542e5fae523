"""What a store offers, declared once: the calls a rollout worker and the RL loop make, whichever layer answers them.

    StoreClient      store/client.py       over Ray, one or several TraceStore shards: what every part of a run uses
    LightningClient  client.py             the same calls over HTTP, for agents that live elsewhere (no Ray there)
    StoreApi         store/http.py         the HTTP routes LightningClient calls, one per operation, named alike
    TraceStore       store/trace_store.py  one shard's actor: the same operations, async, keyed by attempt first
    SQLiteBackend    store/sqlite.py       the shard's durable storage beneath it (clock passed in, rows not spans)

The rollout runner (rollout/runner.py) takes any RolloutStore, so a Ray worker and a Lightning client run agents with
the same code. tests/unit/test_store_protocol.py checks every layer against this.
"""

from __future__ import annotations

from typing import Protocol

from lightning_ray.store.errors import StoreError
from lightning_ray.types import Attempt, AttemptPolicy, Rollout, Span, Task, Verdict


class RolloutStore(Protocol):
    def enqueue(self, tasks: list[Task], config: AttemptPolicy | None = None,
                queue: str = "default") -> list[Rollout]:
        """A rollout per task on `queue`, each with its attempts' settings (`config`)."""

    def dequeue(self, worker_id: str | None = None, attempt_id: str | None = None,
                queue: str = "default") -> Rollout | None:
        """The next rollout of `queue`, leased to a new attempt (named `attempt_id` if given: asking again under
        the same id gets the same lease back); None when the queue is empty."""

    def dequeue_batch(self, attempt_ids: list[str], worker_id: str | None = None,
                      queue: str = "default") -> list[Rollout | None]:
        """`dequeue` for several attempts in one call, a result per id in order: an id asked again gets its lease
        back, one whose attempt already ended gets None, new ids lease the oldest rollouts (None once none waits)."""

    def heartbeat(self, rollout_id: str, attempt_id: str) -> Attempt:
        """The attempt is alive: its lease is extended."""

    def finish_attempt(self, rollout_id: str, attempt_id: str, status: str, reward: float | None = None,
                       error: str | None = None) -> Rollout:
        """The attempt's end, with its reward or error (only a platform failure is retried, while tries are left)."""

    def finish_attempts(self, verdicts: list[Verdict]) -> list[Rollout | StoreError]:
        """`finish_attempt` for several attempts in one call: each verdict's rollout, or the error it met (that verdict
        changes nothing; the others are taken)."""

    def wait_for_rollouts(self, rollout_ids: list[str], timeout: float | None = None) -> list[Rollout]:
        """Those of the rollouts that ended within `timeout` seconds (None: all of them)."""

    def add_spans(self, spans: list[Span]) -> dict:
        """Record spans (idempotent by span id): {"accepted": n, "rejected": n, "errors": [...]}."""

    def query_spans(self, rollout_ids: list[str] | None = None, *, attempt_id: str | None = None,
                    name: str | None = None, since: float | None = None, until: float | None = None,
                    limit: int | None = None) -> list[Span]:
        """Spans by rollout (None: all), attempt, name and start time, oldest first."""

    def stats(self) -> dict:
        """Rollouts per status, span count, errors per kind."""
