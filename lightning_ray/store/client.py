"""StoreClient: the one handle every component uses to reach the store, over one or several TraceStore shards.

Rollouts are sharded by a stable hash of their id, so a rollout, its attempts and its spans live on one shard;
calls that name no rollout fan out and merge. Span rows are encoded here, on the sender's CPU, and decoded here, on
the reader's: not on the store's.
"""

from __future__ import annotations

import asyncio
import math
import random
import zlib
from collections import defaultdict
from pathlib import Path

import ray

from lightning_ray.store.errors import InvalidSpans, StoreError, UnknownRollout
from lightning_ray.store.rows import rollout_of, rollout_row, span_from_row, span_row
from lightning_ray.store.trace_store import TraceStore
from lightning_ray.tracing import semconv
from lightning_ray.types import Attempt, AttemptPolicy, CancelOutcome, Rollout, Span, Task, Verdict, new_id


class StoreClient:
    """A RolloutStore (store/protocol.py) over Ray, and the operator's calls beside it (cancel, queries, retention)."""

    def __init__(self, shards: list):
        self.shards = shards
        self._next = random.randrange(len(shards))  # spread dequeues of different workers over the shards

    @classmethod
    def start(cls, run_dir: str | Path | None = None, num_shards: int = 1, label: str | None = None,
              actor_options: dict | None = None, **options) -> StoreClient:
        """Start the shard actors: SQLite files traces[-i].sqlite in `run_dir`, or in memory when it is None;
        named trace-store-<i>@<label> (unique in the namespace) when a label is given; `actor_options` place them
        (Ray's .options())."""
        def path(i):
            return ":memory:" if run_dir is None else str(Path(run_dir) / (f"traces-{i}.sqlite" if num_shards > 1
                                                                           else "traces.sqlite"))
        return cls([TraceStore.options(name=label and f"trace-store-{i}@{label}", **actor_options or {}).remote(
            path(i), **options) for i in range(num_shards)])

    def close(self) -> None:
        """Ends the shard actors (their SQLite files stay: every write is committed as it is made)."""
        for shard in self.shards:
            ray.kill(shard, no_restart=True)

    def _index(self, key: str) -> int:
        return zlib.crc32(key.encode()) % len(self.shards)

    def shard(self, key: str):
        return self.shards[self._index(key)]

    def _by_shard(self, keys: list[str]) -> dict[int, list[int]]:
        """Positions of `keys` grouped by shard index."""
        groups = defaultdict(list)
        for i, k in enumerate(keys):
            groups[self._index(k)].append(i)
        return groups

    # --- the rollout queue ---------------------------------------------------------------------------------

    def enqueue(self, tasks: list[Task], config: AttemptPolicy | None = None, queue: str = "default") -> list[Rollout]:
        rollouts = [Rollout(rollout_id=new_id("ro"), task=t, config=config or AttemptPolicy(), queue=queue)
                    for t in tasks]
        groups = self._by_shard([r.rollout_id for r in rollouts])
        ray.get([self.shards[s].enqueue.remote([rollout_row(rollouts[i]) for i in idx]) for s, idx in groups.items()])
        return rollouts

    def dequeue(self, worker_id: str | None = None, attempt_id: str | None = None,
                queue: str = "default") -> Rollout | None:
        """Lease the next rollout of `queue` to a new attempt, named `attempt_id` if given; None when it is empty on
        every shard. Asking again under the same id (a reply lost over HTTP) gets the same rollout back."""
        if attempt_id is not None and len(self.shards) > 1:  # not from another shard, which may have rollouts now
            for leased in ray.get([s.leased.remote(attempt_id) for s in self.shards]):
                if leased is not None:
                    return leased[0]
        for k in range(len(self.shards)):
            shard = self.shards[(self._next + k) % len(self.shards)]
            leased = ray.get(shard.dequeue.remote(worker_id, attempt_id, queue))
            if leased is not None:
                self._next = (self._next + k + 1) % len(self.shards)
                return leased[0]
        return None

    def dequeue_batch(self, attempt_ids: list[str], worker_id: str | None = None,
                      queue: str = "default") -> list[Rollout | None]:
        """`dequeue` for several attempts: one call to a single shard; with several, one call per attempt (an id
        asked again may have its lease on any shard)."""
        if len(self.shards) > 1:
            return [self.dequeue(worker_id, a, queue) for a in attempt_ids]
        return [row and rollout_of(row) for row in ray.get(self.shards[0].dequeue_batch.remote(attempt_ids, worker_id,
                                                                                               queue))]

    def heartbeat(self, rollout_id: str, attempt_id: str) -> Attempt:
        return ray.get(self.shard(rollout_id).heartbeat.remote(attempt_id, rollout_id))

    def finish_attempt(self, rollout_id: str, attempt_id: str, status: str, reward: float | None = None,
                       error: str | None = None) -> Rollout:
        return ray.get(self.shard(rollout_id).finish_attempt.remote(attempt_id, status, reward, error, rollout_id))

    def finish_attempts(self, verdicts: list[Verdict]) -> list[Rollout | StoreError]:
        """Each verdict's rollout, or the error it met (the others are taken): one call per shard."""
        groups = self._by_shard([v.rollout_id for v in verdicts])
        parts = ray.get([self.shards[s].finish_attempts.remote([verdicts[i] for i in idx])
                         for s, idx in groups.items()])
        out: list = [None] * len(verdicts)
        for idx, part in zip(groups.values(), parts):
            for i, outcome in zip(idx, part):
                out[i] = outcome if isinstance(outcome, StoreError) else rollout_of(outcome)
        return out

    def cancel(self, rollout_ids: list[str]) -> dict[str, CancelOutcome]:
        """Per rollout, in the order asked: "cancelled", "already_ended" or "unknown" (see SQLiteBackend.cancel)."""
        parts = ray.get(self._scatter_refs(rollout_ids, lambda shard, ids: shard.cancel.remote(ids)))
        outcome = {k: v for part in parts for k, v in part.items()}
        return {i: outcome[i] for i in rollout_ids}

    def wait_for_rollouts(self, rollout_ids: list[str], timeout: float | None = None) -> list[Rollout]:
        return self._scatter(rollout_ids, lambda shard, ids: shard.wait_for_rollouts.remote(ids, timeout))

    async def wait_for_rollouts_async(self, rollout_ids: list[str], timeout: float | None = None) -> list[Rollout]:
        refs = self._scatter_refs(rollout_ids, lambda shard, ids: shard.wait_for_rollouts.remote(ids, timeout))
        return _in_order(rollout_ids, await asyncio.gather(*refs))

    def count_rollouts(self, rollout_ids: list[str]) -> dict[str, int]:
        """How many of these rollouts are in each status."""
        counts: dict[str, int] = defaultdict(int)
        for part in ray.get(self._scatter_refs(rollout_ids, lambda shard, ids: shard.count_rollouts.remote(ids))):
            for status, n in part.items():
                counts[status] += n
        return dict(counts)

    def get_rollouts(self, rollout_ids: list[str], strict: bool = False) -> list[Rollout]:
        return self._scatter(rollout_ids, lambda shard, ids: shard.get_rollouts.remote(ids, strict))

    def _scatter(self, rollout_ids: list[str], call) -> list[Rollout]:
        """Send each shard its rollouts; answer in the order asked (rollouts a shard did not return are left out)."""
        return _in_order(rollout_ids, ray.get(self._scatter_refs(rollout_ids, call)))

    def _scatter_refs(self, rollout_ids: list[str], call) -> list:
        return [call(self.shards[s], [rollout_ids[i] for i in idx]) for s, idx in self._by_shard(rollout_ids).items()]

    def query_rollouts(self, status: list[str] | None = None, since: float | None = None,
                       until: float | None = None, limit: int | None = None) -> list[Rollout]:
        parts = ray.get([s.query_rollouts.remote(status, since, until, limit) for s in self.shards])
        return sorted((r for part in parts for r in part), key=lambda r: r.enqueued_at)[:limit]

    async def get_rollout(self, rollout_id: str) -> Rollout | None:
        found = await self.shard(rollout_id).get_rollouts.remote([rollout_id])
        return found[0] if found else None

    def get_attempts(self, rollout_id: str) -> list[Attempt]:
        return ray.get(self.shard(rollout_id).get_attempts.remote(rollout_id))

    # --- spans ---------------------------------------------------------------------------------------------

    def add_spans(self, spans: list[Span], strict: bool = True, origin: str = "client") -> dict:
        """Store spans; with `strict`, raise on any rejected span (the valid ones are stored all the same).
        `origin="server"` is for the policy server's own records; the HTTP store API never passes it."""
        spans, refused = self._refuse(spans)
        return _merged([refused, *ray.get(self._add_span_refs(spans, origin))], strict)

    async def add_spans_async(self, spans: list[Span], strict: bool = True, origin: str = "client") -> dict:
        spans, refused = self._refuse(spans)
        return _merged([refused, *await asyncio.gather(*self._add_span_refs(spans, origin))], strict)

    def _refuse(self, spans: list[Span]) -> tuple[list[Span], dict]:
        """The spans left to store, and a result for those refused here, counted as the store's rejects are:
        rewards that are not finite numbers (checked before encoding: JSON would store NaN and infinity as null)."""
        errors = [(i, p) for i, s in enumerate(spans) if (p := _reward_problem(s))]
        if errors:
            self.count_error("invalid_spans", len(errors))
            bad = {i for i, _ in errors}
            spans = [s for i, s in enumerate(spans) if i not in bad]
        return spans, {"accepted": 0, "duplicates": 0, "rejected": len(errors),
                       "errors": [f"span #{i}: {p}" for i, p in errors[:10]]}

    def _add_span_refs(self, spans: list[Span], origin: str) -> list:
        groups = self._by_shard([s.rollout_id or s.span_id for s in spans])
        return [self.shards[s].add_spans.remote([span_row(spans[i]) for i in idx], origin)
                for s, idx in groups.items()]

    def query_spans(self, rollout_ids: list[str] | None = None, attempt_id: str | None = None,
                    name: str | list[str] | None = None, since: float | None = None, until: float | None = None,
                    limit: int | None = None) -> list[Span]:
        if rollout_ids is None:
            targets = {i: None for i in range(len(self.shards))}
        else:
            targets = {s: [rollout_ids[i] for i in idx] for s, idx in self._by_shard(rollout_ids).items()}
        parts = ray.get([self.shards[s].query_span_rows.remote(ids, attempt_id, name, since, until, limit)
                         for s, ids in targets.items()])
        rows = sorted((r for part in parts for r in part), key=lambda r: r[6])[:limit]  # by start_time
        return [span_from_row(r) for r in rows]

    def delete_spans(self, before: float) -> int:
        """Every shard's spans of rollouts enqueued before `before` (SQLiteBackend.delete_spans)."""
        return sum(ray.get([s.delete_spans.remote(before) for s in self.shards]))

    def stats(self) -> dict:
        parts = ray.get([s.stats.remote() for s in self.shards])
        total = {"rollouts": defaultdict(int), "spans": 0, "errors": defaultdict(int)}
        for p in parts:
            total["spans"] += p["spans"]
            for key in ("rollouts", "errors"):
                for k, v in p[key].items():
                    total[key][k] += v
        return {k: dict(v) if isinstance(v, defaultdict) else v for k, v in total.items()}

    def count_error(self, kind: str, n: int = 1) -> None:
        self.shards[0].count_error.remote(kind, n)


def _reward_problem(span: Span) -> str | None:
    """Why a reward span cannot be stored: a value (the reward or one of its dimensions) that is NaN or infinite."""
    if span.name != semconv.REWARD:
        return None
    for key, value in span.attributes.items():
        if (key == semconv.REWARD_VALUE or key.startswith(f"{semconv.REWARD_VALUE}.")) and isinstance(value, float) \
                and not math.isfinite(value):
            return f"reward {key}={value!r} is not a finite number"
    return None


def _merged(results: list[dict], strict: bool) -> dict:
    merged = {"accepted": 0, "duplicates": 0, "rejected": 0, "errors": []}
    for r in results:
        for k in merged:
            merged[k] += r[k]
    if strict and merged["rejected"]:
        unknown = all("unknown rollout_id" in e for e in merged["errors"])
        raise (UnknownRollout if unknown else InvalidSpans)(
            f"{merged['rejected']} span(s) rejected: " + "; ".join(merged["errors"]))
    return merged


def _in_order(rollout_ids: list[str], parts: list[list[Rollout]]) -> list[Rollout]:
    found = {r.rollout_id: r for part in parts for r in part}
    return [found[i] for i in rollout_ids if i in found]
