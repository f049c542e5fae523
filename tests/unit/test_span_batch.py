"""An attempt's span buffer (tracing/context.py SpanBatch): what reaches the sink, and when, with spans ending on
several threads and a sink that fails or is slow; the runner's sink into the store; the context's reach."""

from __future__ import annotations

import threading
import time

import pytest

from lightning_ray.tracing.context import SpanBatch
from lightning_ray.types import Span


def spans(n: int, start: int = 0) -> list[Span]:
    return [Span(span_id=f"s{i}", name="step", start_time=float(i)) for i in range(start, start + n)]


def test_spans_kept_after_failures_go_again_a_batch_at_a_time():
    """A store down for a while: the kept spans are retried with the next batch, never in one call larger than
    the batch size (the store refuses a call past its limit, which would keep them for ever)."""
    calls, stored = [], []

    def sink(batch):
        calls.append(len(batch))
        if len(calls) <= 3:
            raise ConnectionError("store restarting")
        stored.extend(batch)

    batch = SpanBatch(sink, size=3)
    for s in spans(10):
        batch.add(s)
    batch.flush()
    assert max(calls) == 3 and sorted(s.span_id for s in stored) == sorted(f"s{i}" for i in range(10))


def test_flush_waits_for_a_batch_another_thread_is_handing_over():
    """A tool thread's span fills a batch whose hand-over is slow: the attempt's flush returns only once that batch
    is stored, and when it fails, flush hands it over itself (it was lost, the attempt ended as if complete)."""
    handing, release, stored, calls = threading.Event(), threading.Event(), [], []

    def sink(batch):
        calls.append(len(batch))
        if len(calls) == 1:
            handing.set()
            release.wait(5)
            raise ConnectionError("store restarting")
        stored.extend(batch)

    batch = SpanBatch(sink, size=2)
    tool = threading.Thread(target=lambda: [batch.add(s) for s in spans(2)])
    tool.start()
    assert handing.wait(5)
    batch.add(spans(1, start=2)[0])
    flushed = threading.Thread(target=batch.flush)
    flushed.start()
    time.sleep(0.2)
    assert flushed.is_alive() and stored == []  # waiting for the tool thread's hand-over
    release.set()
    flushed.join(5)
    tool.join(5)
    assert not flushed.is_alive() and sorted(s.span_id for s in stored) == ["s0", "s1", "s2"]


def test_the_final_flush_raises_when_the_store_stays_unreachable():
    def down(batch):
        raise ConnectionError("store down")

    batch = SpanBatch(down, size=4)
    batch.add(spans(1)[0])
    with pytest.raises(ConnectionError, match="store down"):
        batch.flush()


def test_the_attempts_sink_drops_what_the_store_refuses_and_raises_what_it_could_not_take():
    """A span the store refuses would be refused at every try: dropped, the rest stored. A 5xx (a proxy's, a store
    restarting) is no refusal: raised, so SpanBatch tries again and the attempt's end learns its trace is not whole.
    (A stand-in store: a real one answers neither on demand.)"""
    from lightning_ray.rollout.runner import _span_sink
    from lightning_ray.store.errors import InvalidSpans, StoreError

    class Store:
        def __init__(self, error):
            self.error = error

        def add_spans(self, spans):
            raise self.error

    _span_sink(Store(InvalidSpans("span #0: span_id and name must be non-empty strings")), "r")(spans(1))
    unavailable = StoreError("503 Service Unavailable")
    with pytest.raises(StoreError, match="503"):
        _span_sink(Store(unavailable), "r")(spans(1))


def test_a_process_pool_still_runs_under_a_traced_attempt():
    """asyncio's run_in_executor carries the attempt's context into thread pools only: a context does not pickle."""
    import asyncio
    from concurrent.futures import ProcessPoolExecutor

    from lightning_ray.tracing import trace_attempt

    async def squared():
        with ProcessPoolExecutor(1) as pool:
            return await asyncio.get_running_loop().run_in_executor(pool, pow, 7, 2)

    with trace_attempt("ro-p", "at-p", lambda spans: None):
        assert asyncio.run(squared()) == 49
