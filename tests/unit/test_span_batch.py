"""An attempt's span buffer (tracing/context.py SpanBatch): what reaches the sink, and when, with spans ending on
several threads and a sink that fails or is slow."""

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
