"""SpanWriter (the policy replica's grouped span writes), against a real store actor."""

from __future__ import annotations

import asyncio

import pytest

from lightning_ray.store.client import StoreClient
from lightning_ray.store.errors import UnknownRollout
from lightning_ray.store.span_writer import SpanWriter
from lightning_ray.types import Span, Task


class CountedStore(StoreClient):
    """The real store client, counting the span calls that carried the writes."""

    calls = 0

    async def add_spans_async(self, spans, strict=True, origin="client"):
        self.calls += 1
        return await super().add_spans_async(spans, strict, origin)


def call_span(rollout_id: str) -> Span:
    return Span(rollout_id=rollout_id, attempt_id="a", name="llm.call", attributes={"ids": [1, 2, 3]})


def test_writes_that_end_together_share_one_store_call_and_each_is_stored_once(ray_cluster):
    store = CountedStore(StoreClient.start().shards)
    rollouts = store.enqueue([Task(task_id=f"t{i}", input={}) for i in range(4)])
    writes = [[call_span(r.rollout_id) for _ in range(2)] for r in rollouts for _ in range(50)]

    async def run():
        writer = SpanWriter(store, origin="server")
        await writer.write(writes[0])  # alone: straight to the store
        assert store.calls == 1
        await asyncio.gather(*(writer.write(w) for w in writes[1:]))  # 199 calls ending in one tick

    asyncio.run(run())
    assert store.calls == 2
    stored = store.query_spans([r.rollout_id for r in rollouts])
    assert sorted(s.span_id for s in stored) == sorted(s.span_id for w in writes for s in w)


def test_a_refused_write_fails_alone_and_the_rest_of_its_group_is_stored_once(ray_cluster):
    store = CountedStore(StoreClient.start().shards)
    [rollout] = store.enqueue([Task(task_id="t", input={})])
    good = [[call_span(rollout.rollout_id)] for _ in range(5)]

    async def run():
        writer = SpanWriter(store, origin="server")
        return await asyncio.gather(*(writer.write(w) for w in [*good[:2], [call_span("gone")], *good[2:]]),
                                    return_exceptions=True)

    results = asyncio.run(run())
    assert [type(r) for r in results] == [type(None)] * 2 + [UnknownRollout] + [type(None)] * 3
    assert "gone" in str(results[2])
    assert store.calls == 1 + 6  # the group, then each write alone for its own answer
    stored = store.query_spans([rollout.rollout_id])
    assert sorted(s.span_id for s in stored) == sorted(w[0].span_id for w in good)  # none twice


def test_a_group_over_the_stores_batch_limit_still_stores_every_write(ray_cluster):
    store = StoreClient.start(max_batch_spans=3)
    [rollout] = store.enqueue([Task(task_id="t", input={})])
    writes = [[call_span(rollout.rollout_id) for _ in range(2)] for _ in range(4)]

    async def run():
        writer = SpanWriter(store, origin="server")
        await asyncio.gather(*(writer.write(w) for w in writes))

    asyncio.run(run())
    assert len(store.query_spans([rollout.rollout_id])) == 8


def test_a_caller_cancelled_mid_write_leaves_its_spans_stored(ray_cluster):
    """The client of a call that goes away while its spans are on their way: the call is still recorded."""
    store = StoreClient.start()
    [rollout] = store.enqueue([Task(task_id="t", input={})])
    spans = [call_span(rollout.rollout_id) for _ in range(3)]

    async def run():
        writer = SpanWriter(store, origin="server")
        caller = asyncio.create_task(writer.write(spans))
        await asyncio.sleep(0)  # the write is on its way
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        await writer.writing  # the group goes on to the store all the same

    asyncio.run(run())
    assert sorted(s.span_id for s in store.query_spans([rollout.rollout_id])) == sorted(s.span_id for s in spans)
