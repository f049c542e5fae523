"""The SQLite trace store: the rollout queue and spans, durable in one file."""

from __future__ import annotations

import time

import ray

from lightning_ray.store.sqlite import SQLiteBackend
from lightning_ray.store.trace_store import TraceStore
from lightning_ray.types import Rollout, Span, Task


def test_queue_is_first_in_first_out_and_each_rollout_is_claimed_once(tmp_path):
    store = SQLiteBackend(tmp_path / "t.sqlite")

    store.add_rollouts([Rollout(rollout_id=f"r{i}", task=Task(task_id=f"t{i}", input={"i": i})) for i in range(3)])
    claimed = [store.claim_next(lambda r: f"{r}-a") for _ in range(4)]
    assert [c.rollout_id for c in claimed[:3]] == ["r0", "r1", "r2"] and claimed[3] is None
    assert all(c.status == "running" and c.attempt_id == f"{c.rollout_id}-a" for c in claimed[:3])


def test_spans_are_idempotent_and_survive_reopening(tmp_path):
    path = tmp_path / "t.sqlite"
    spans = [Span(rollout_id="r", name="llm.call", start_time=i, attributes={"ids": list(range(i))}) for i in range(5)]
    store = SQLiteBackend(path)
    assert store.add_spans(spans) == 5
    assert store.add_spans(spans[:2]) == 0  # a re-sent batch is not duplicated
    del store
    reopened = SQLiteBackend(path).get_spans(["r"])
    assert [s.span_id for s in reopened] == [s.span_id for s in spans]
    assert reopened[3].attributes == {"ids": [0, 1, 2]}


def test_store_actor_restarts_from_its_file(ray_cluster, tmp_path):
    store = TraceStore.remote(str(tmp_path / "t.sqlite"))
    ids = ray.get(store.enqueue.remote([Task(task_id="t", input={})]))
    ray.get(store.add_spans.remote([Span(rollout_id=ids[0], name="reward")]))
    ray.kill(store, no_restart=False)  # the actor process dies; Ray restarts it from the same file
    assert len(call_when_back(lambda: store.get_spans.remote(ids))) == 1
    assert call_when_back(lambda: store.get_rollouts.remote(ids))[0].status == "queued"


def call_when_back(call, tries: int = 100):
    """Calls made while the actor restarts fail with RayActorError; retry (these reads are idempotent)."""
    for _ in range(tries):
        try:
            return ray.get(call())
        except ray.exceptions.RayActorError:
            time.sleep(0.1)
    raise AssertionError("the store never came back")
