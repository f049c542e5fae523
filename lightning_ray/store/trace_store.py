"""The TraceStore actor: the rollout queue (leases, heartbeats, retries) and every span, durable in SQLite.

Ray restarts it after a crash and retries the calls that were in flight; enqueues (ids chosen by the caller) and
span batches (ids chosen by the sender) are idempotent, so a retried call never duplicates anything. So is a
dequeue under an attempt id the worker chose: its retry gets the lease that the lost reply carried.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ray

from lightning_ray.metrics import count_error, metrics
from lightning_ray.store.errors import BatchTooLarge, StoreError
from lightning_ray.store.sqlite import SQLiteBackend
from lightning_ray.types import FINISHED, Attempt, CancelOutcome, Rollout, Span, Verdict

logger = logging.getLogger(__name__)


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class TraceStore:
    """One shard: store/protocol.py's operations, async, keyed by attempt first and on the rows StoreClient encodes
    (tests/unit/test_store_protocol.py checks them by name against the protocol)."""

    async def __init__(self, path: str | Path = ":memory:", max_batch_spans: int = 10_000,
                       expire_every_s: float = 0.2):
        self.backend = SQLiteBackend(path)
        # Every SQLite call runs on one thread: serialised as SQLite wants, while the event loop keeps receiving
        # and unpickling the next batch (sqlite3 releases the GIL while it writes).
        self.db_thread = ThreadPoolExecutor(1, thread_name_prefix="sqlite")
        self.max_batch_spans = max_batch_spans
        self.errors: Counter[str] = Counter()
        self.finished = asyncio.Condition()  # notified whenever some rollout may have ended
        self._expiry = asyncio.get_running_loop().create_task(self._expire_forever(expire_every_s))
        self._checkpoints = asyncio.get_running_loop().create_task(self._checkpoint_forever())

    async def _expire_forever(self, every: float) -> None:
        while True:
            try:
                if await self._call(self.backend.expire, time.time()):
                    await self._notify()
            except Exception:  # a background loop must outlive one bad pass
                logger.exception("expiring attempts failed; retrying")
            await asyncio.sleep(every)

    async def _checkpoint_forever(self, every: float = 1.0) -> None:
        """WAL checkpoints on their own thread: their disk writes overlap the writes instead of stalling them."""
        with ThreadPoolExecutor(1, thread_name_prefix="checkpoint") as thread:
            while True:
                try:
                    await asyncio.get_running_loop().run_in_executor(thread, self.backend.checkpoint)
                except Exception:
                    logger.exception("WAL checkpoint failed; retrying")
                await asyncio.sleep(every)

    async def _notify(self) -> None:
        async with self.finished:
            self.finished.notify_all()

    def count_error(self, kind: str, n: int = 1) -> None:
        """Rejected input, counted here and on the Ray dashboard (also called by the HTTP front for bad OTLP)."""
        if n > 0:
            self.errors[kind] += n
            count_error("store", kind, n)

    async def _call(self, fn, *args):
        """Run a backend call on the SQLite thread; a StoreError it raises is counted, then passed on."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.db_thread, fn, *args)
        except StoreError as e:
            self.count_error(e.code)
            raise

    # --- the rollout queue ---------------------------------------------------------------------------------

    # The batch calls take and give rollouts as their rows (rows.rollout_row / rollout_of, on the caller's side):
    # this actor's one thread bounds the store's rollouts/s, and plain values cost it a fraction of the models.

    async def enqueue(self, rows: list[tuple]) -> int:
        return await self._call(self.backend.enqueue_rows, rows)

    async def dequeue(self, worker_id: str | None = None, attempt_id: str | None = None,
                      queue: str = "default") -> tuple[Rollout, Attempt] | None:
        return await self._call(self.backend.dequeue, worker_id, time.time(), attempt_id, queue)

    async def dequeue_batch(self, attempt_ids: list[str], worker_id: str | None = None,
                            queue: str = "default") -> list[tuple | None]:
        """The rollouts' rows only (what a worker runs): the attempts stay here, one object less each to send back."""
        leased = await self._call(self.backend.dequeue_rows, worker_id, time.time(), attempt_ids, queue)
        return [lease and lease[0] for lease in leased]

    async def leased(self, attempt_id: str) -> tuple[Rollout, Attempt] | None:
        return await self._call(self.backend.leased, attempt_id)

    async def heartbeat(self, attempt_id: str, rollout_id: str | None = None) -> Attempt:
        return await self._call(self.backend.heartbeat, attempt_id, time.time(), rollout_id)

    async def finish_attempt(self, attempt_id: str, status: str, reward: float | None = None,
                             error: str | None = None, rollout_id: str | None = None) -> Rollout:
        rollout = await self._call(self.backend.finish_attempt, attempt_id, status, time.time(), reward, error,
                                   rollout_id)
        await self._notify()
        return rollout

    async def finish_attempts(self, verdicts: list[Verdict]) -> list[tuple | StoreError]:
        outcomes = await self._call(self.backend.finish_rows, verdicts, time.time())
        for e in outcomes:
            if isinstance(e, StoreError):
                self.count_error(e.code)
        await self._notify()
        return outcomes

    async def cancel(self, rollout_ids: list[str]) -> dict[str, CancelOutcome]:
        outcome = await self._call(self.backend.cancel, rollout_ids, time.time())
        await self._notify()
        return outcome

    async def wait_for_rollouts(self, rollout_ids: list[str], timeout: float | None = None) -> list[Rollout]:
        """Block until every rollout has ended (or the timeout passes); return the ended ones."""
        deadline = None if timeout is None else time.monotonic() + timeout
        async with self.finished:
            while True:  # woken by every verdict: count in SQL, read the rollouts only once at the end
                counts = await self._call(self.backend.count_rollouts, rollout_ids)
                left = None if deadline is None else deadline - time.monotonic()
                if sum(counts.get(s, 0) for s in FINISHED) == len(set(rollout_ids)) or (left is not None and left <= 0):
                    rollouts = await self._call(self.backend.get_rollouts, rollout_ids)
                    return [r for r in rollouts if r.status in FINISHED]
                try:
                    await asyncio.wait_for(self.finished.wait(), left)
                except asyncio.TimeoutError:
                    pass

    # --- spans ---------------------------------------------------------------------------------------------

    async def add_spans(self, rows: list[tuple], origin: str = "client") -> dict:
        """Store a batch of span rows (see rows.span_row); invalid ones are rejected with reasons and counted."""
        if len(rows) > self.max_batch_spans:
            self.count_error(BatchTooLarge.code)
            raise BatchTooLarge(f"{len(rows)} spans in one batch; the limit is {self.max_batch_spans}")
        result = await self._call(self.backend.add_span_rows, rows, origin)
        if result["rejected"]:
            self.count_error("invalid_spans", result["rejected"])
        if result["accepted"]:
            metrics().store_spans.inc(result["accepted"])
        return result

    # --- queries -------------------------------------------------------------------------------------------

    async def get_rollouts(self, rollout_ids: list[str], strict: bool = False) -> list[Rollout]:
        return await self._call(self.backend.get_rollouts, rollout_ids, strict)

    async def query_rollouts(self, status: list[str] | None = None, since: float | None = None,
                             until: float | None = None, limit: int | None = None) -> list[Rollout]:
        return await self._call(self.backend.query_rollouts, status, since, until, limit)

    async def get_attempts(self, rollout_id: str) -> list[Attempt]:
        return await self._call(self.backend.get_attempts, rollout_id)

    async def delete_spans(self, before: float) -> int:
        return await self._call(self.backend.delete_spans, before)

    async def query_spans(self, rollout_ids: list[str] | None = None, attempt_id: str | None = None,
                          name: str | list[str] | None = None, since: float | None = None, until: float | None = None,
                          limit: int | None = None) -> list[Span]:
        return await self._call(self.backend.query_spans, rollout_ids, attempt_id, name, since, until, limit)

    async def query_span_rows(self, rollout_ids: list[str] | None = None, attempt_id: str | None = None,
                              name: str | list[str] | None = None, since: float | None = None,
                              until: float | None = None, limit: int | None = None) -> list[tuple]:
        """query_spans, left to the caller to decode (rows.span_from_row): StoreClient reads spans this way."""
        return await self._call(self.backend.query_span_rows, rollout_ids, attempt_id, name, since, until, limit)

    async def count_rollouts(self, rollout_ids: list[str] | None = None) -> dict[str, int]:
        return await self._call(self.backend.count_rollouts, rollout_ids)

    async def stats(self) -> dict:
        return {"rollouts": await self._call(self.backend.count_rollouts),
                "spans": await self._call(self.backend.count_spans), "errors": dict(self.errors)}
