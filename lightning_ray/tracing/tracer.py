"""The embedded tracer: spans without OpenTelemetry, equal to the ones the OpenTelemetry SDK would make.

Same id format (32/16 hex chars), parent/child links through a contextvar, status ERROR and an `exception` event
when an exception leaves a span, the SDK's status rules. Finished spans go to the attempt's SpanBatch."""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar
from typing import Any

from lightning_ray.tracing import semconv
from lightning_ray.tracing.context import SpanBatch
from lightning_ray.tracing.spans import (
    attribute_value, clean_attributes, exception_attributes, make_span, new_span_id, new_trace_id,
)
from lightning_ray.types import SpanEvent

logger = logging.getLogger(__name__)

_current_span: ContextVar[LiveSpan | None] = ContextVar("lightning_ray_span", default=None)


class LiveSpan:
    """A started span. Its methods are the subset of OpenTelemetry's Span that `span(...)` callers may use, with the
    same behaviour: set_attribute(s), add_event, record_exception, set_status, end."""

    __slots__ = ("_batch", "_token", "trace_id", "span_id", "parent_id", "name", "start_time", "attributes",
                 "events", "status", "status_message", "ended")

    def __init__(self, batch: SpanBatch, ids: dict[str, str], name: str, attributes: dict[str, Any] | None = None):
        parent = _current_span.get()
        self.trace_id = parent.trace_id if parent else new_trace_id()
        self.parent_id = parent.span_id if parent else None
        self.span_id = new_span_id()
        self._batch, self._token, self.name = batch, None, name
        self.attributes = clean_attributes(attributes) if attributes else {}
        self.attributes.update(ids)  # stamped at start, as the OpenTelemetry path's AttemptSpanProcessor does
        self.events: list[SpanEvent] = []
        self.status, self.status_message, self.ended = "unset", None, False
        self.start_time = time.time_ns() / 1e9

    def __enter__(self) -> LiveSpan:
        self._token = _current_span.set(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            _current_span.reset(self._token)
        except ValueError:
            # Closed in another context (an async generator the event loop finalizes in a task of its own): as the
            # OpenTelemetry SDK does, the span still ends; only this context's current span is left as it is.
            logger.debug("span %r closed in another context than it was opened in", self.name)
        # As OpenTelemetry's use_span: only Exception is an error (not GeneratorExit, KeyboardInterrupt).
        if isinstance(exc, Exception):
            self.record_exception(exc)
            self.set_status("error", f"{type(exc).__name__}: {exc}")
        self.end()

    def set_attribute(self, key: str, value: Any) -> None:
        if not self.ended and key and isinstance(key, str):  # the SDK drops an invalid key here
            self.attributes[key] = attribute_value(value)

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def add_event(self, name: str, attributes: dict[str, Any] | None = None, timestamp: int | None = None) -> None:
        if not self.ended:
            t = (timestamp if timestamp is not None else time.time_ns()) / 1e9
            self.events.append(SpanEvent(name=name, time=t, attributes=clean_attributes(attributes or {})))

    def record_exception(self, exception: BaseException, attributes: dict[str, Any] | None = None,
                         timestamp: int | None = None, escaped: bool = False) -> None:
        self.add_event(semconv.EXCEPTION, {**exception_attributes(exception, escaped), **(attributes or {})},
                       timestamp)

    def set_status(self, status: Any, description: str | None = None) -> None:
        """status: "ok" / "error" / "unset", or OpenTelemetry's StatusCode or Status. As in the SDK, OK is final,
        UNSET changes nothing, and only an error keeps its description."""
        if hasattr(status, "status_code"):  # an OpenTelemetry Status
            status, description = status.status_code, status.description
        status = getattr(status, "name", status).lower()
        if status not in ("ok", "error", "unset"):
            raise ValueError(f"span status is ok, error or unset, not {status!r}")
        if self.status == "ok" or status == "unset":
            return
        self.status, self.status_message = status, description if status == "error" else None

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        self._batch.add(make_span(
            self.trace_id, self.span_id, self.parent_id, self.name, self.start_time, time.time_ns() / 1e9,
            self.status, self.status_message, self.attributes, self.events))


class EmbeddedTracer:
    """The tracer of one attempt under the embedded backend."""

    def __init__(self, batch: SpanBatch, rollout_id: str, attempt_id: str):
        self._batch = batch
        self._ids = {semconv.ROLLOUT_ID: rollout_id, semconv.ATTEMPT_ID: attempt_id}

    def span(self, name: str, attributes: dict[str, Any] | None = None) -> LiveSpan:
        return LiveSpan(self._batch, self._ids, name, attributes)

    def record(self, name: str, attributes: dict[str, Any], status: str = "unset", message: str | None = None,
               exception: BaseException | None = None) -> None:
        """A span that starts and ends now, a child of the current one (what the emitters write)."""
        s = LiveSpan(self._batch, self._ids, name, attributes)
        if exception is not None:
            s.record_exception(exception)
        s.set_status(status, message)
        s.end()
