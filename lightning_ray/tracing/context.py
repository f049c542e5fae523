"""The attempt being traced: which rollout/attempt new spans belong to, and where its spans are buffered."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from lightning_ray.types import Span

Sink = Callable[[list[Span]], None]

logger = logging.getLogger(__name__)


class SpanBatch:
    """One attempt's finished spans, handed to the sink `size` at a time (one store call per batch, not per span)
    and the rest on `flush`. A failing sink does not disturb the agent mid-run: the batch is kept and retried with
    the next one (the store ignores a span it already has); only the attempt's final `flush` raises, so the worker
    learns that its spans did not arrive. `flush` first waits for batches other threads are handing over."""

    def __init__(self, sink: Sink, size: int = 512):
        self.sink, self.size = sink, size
        self._spans: list[Span] = []
        self._next = size  # hand over when this many are buffered (grows after a failure: no retry per span)
        self._sending = 0  # batches being handed over, by other threads too
        self._lock = threading.Condition()  # spans may end on several threads (an agent's tool pool)

    def add(self, span: Span) -> None:
        with self._lock:
            self._spans.append(span)
            if len(self._spans) < self._next:
                return
            batch, self._spans = self._spans, []
            self._sending += 1
        try:
            self._hand_over(batch)
        except Exception:
            logger.warning("handing %d spans to the sink failed; keeping them for the next try", len(batch),
                           exc_info=True)
            with self._lock:
                self._spans[:0] = batch
                self._next = len(self._spans) + self.size
        else:
            with self._lock:
                self._next = self.size
        finally:
            with self._lock:
                self._sending -= 1
                self._lock.notify_all()

    def flush(self) -> None:
        with self._lock:
            self._lock.wait_for(lambda: not self._sending)
            batch, self._spans = self._spans, []
        self._hand_over(batch)

    def _hand_over(self, batch: list[Span]) -> None:
        for i in range(0, len(batch), self.size):  # kept ones too: a store call's size stays bounded
            self.sink(batch[i : i + self.size])


@dataclass(frozen=True)
class AttemptTrace:
    rollout_id: str
    attempt_id: str
    batch: SpanBatch
    tracer: Any  # EmbeddedTracer or otel.OtelTracer: span(name, attributes) and record(...)


current_attempt: ContextVar[AttemptTrace | None] = ContextVar("lightning_ray_attempt", default=None)

# Attempts running in this process by (rollout_id, attempt_id): where an OpenTelemetry span stamped with those ids
# is delivered when it ends, whichever thread or context ends it.
live_attempts: dict[tuple[str, str], AttemptTrace] = {}
