"""The OpenTelemetry path: spans from the OpenTelemetry SDK (ours or any instrumentation's) become our Spans.

`setup_otel` gives the process one TracerProvider with an AttemptSpanProcessor: every span started while an attempt
is traced gets that attempt's rollout/attempt ids stamped on it (so an agent framework's own spans join the
rollout), and when it ends it is converted and buffered with the attempt's spans. Spans ending outside any attempt
go to an optional fallback sink through the SDK's BatchSpanProcessor and our SinkSpanExporter.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace import Span as SdkSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import Status, StatusCode

from lightning_ray.tracing import semconv
from lightning_ray.tracing.agent_header import AgentHeader, AgentSpans
from lightning_ray.tracing.context import Sink, current_attempt, live_attempts
from lightning_ray.tracing.spans import ResourceInfo, clean_attributes, make_span
from lightning_ray.types import Span, SpanEvent

logger = logging.getLogger(__name__)

_STATUS = {StatusCode.UNSET: "unset", StatusCode.OK: "ok", StatusCode.ERROR: "error"}
_CODES = {"ok": StatusCode.OK, "error": StatusCode.ERROR}

# Spans are RL data: nothing may be dropped or truncated silently (the SDK's defaults keep 128 attributes).
_UNLIMITED = SpanLimits(max_span_attributes=SpanLimits.UNSET, max_events=SpanLimits.UNSET,
                        max_event_attributes=SpanLimits.UNSET, max_attribute_length=SpanLimits.UNSET,
                        max_span_attribute_length=SpanLimits.UNSET)


def span_from_otel(span: ReadableSpan) -> Span:
    ctx, parent, status = span.context, span.parent, span.status
    return make_span(
        f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}", f"{parent.span_id:016x}" if parent else None, span.name,
        span.start_time / 1e9, None if span.end_time is None else span.end_time / 1e9,
        _STATUS[status.status_code], status.description,
        clean_attributes(_plain(getattr(span, "_attributes", span.attributes))),
        [SpanEvent(name=e.name, time=e.timestamp / 1e9, attributes=clean_attributes(_plain(e.attributes)))
         for e in span.events],
        _resource_info(span.resource),
    )


def _plain(attributes: Mapping[str, Any] | None) -> Mapping[str, Any]:
    # The SDK's BoundedAttributes wraps a plain dict; reading that dict skips the Mapping ABC's Python-level
    # item access (~0.2 µs per attribute). Any other mapping works too, only slower.
    return {} if attributes is None else getattr(attributes, "_dict", attributes)


_last_resource: tuple[Resource | None, ResourceInfo] = (None, ResourceInfo())


def _resource_info(resource: Resource) -> ResourceInfo:
    # A process has one resource, or very few: remember the last instead of converting it for every span.
    global _last_resource
    last, info = _last_resource
    if last is not resource:
        info = ResourceInfo.of(resource.attributes)
        _last_resource = (resource, info)
    return info


class SinkSpanExporter(SpanExporter):
    """A SpanExporter that hands the SDK's finished spans, as our Spans, to a sink (e.g. the trace store)."""

    def __init__(self, sink: Sink):
        self.sink = sink

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            self.sink([span_from_otel(s) for s in spans])
        except Exception:
            logger.exception("exporting %d spans failed", len(spans))
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS


class AttemptSpanProcessor(SpanProcessor):
    """Stamps the traced attempt's ids on each span at start; at end delivers the span to that attempt's batch (found
    by the stamped ids, so a span ended on another thread still arrives), else to `fallback`."""

    def __init__(self, fallback: SpanProcessor | None = None):
        self.fallback = fallback

    def on_start(self, span: SdkSpan, parent_context: Context | None = None) -> None:
        attempt = current_attempt.get()
        if attempt is not None:
            span.set_attributes({semconv.ROLLOUT_ID: attempt.rollout_id, semconv.ATTEMPT_ID: attempt.attempt_id})
        if self.fallback is not None:
            self.fallback.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        attributes = span.attributes
        attempt = live_attempts.get((attributes.get(semconv.ROLLOUT_ID), attributes.get(semconv.ATTEMPT_ID)))
        if attempt is not None:
            attempt.batch.add(span_from_otel(span))
        elif self.fallback is not None:
            self.fallback.on_end(span)

    def shutdown(self) -> None:
        if self.fallback is not None:
            self.fallback.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.fallback.force_flush(timeout_millis) if self.fallback is not None else True


class OtelTracer:
    """The tracer of one attempt under the OpenTelemetry backend (the same interface as EmbeddedTracer)."""

    def __init__(self, provider: trace.TracerProvider):
        self._tracer = provider.get_tracer("lightning_ray.tracing")

    def span(self, name: str, attributes: dict[str, Any] | None = None):
        return self._tracer.start_as_current_span(name, attributes=attributes)

    def record(self, name: str, attributes: dict[str, Any], status: str = "unset", message: str | None = None,
               exception: BaseException | None = None) -> None:
        s = self._tracer.start_span(name, attributes=attributes)
        if exception is not None:
            s.record_exception(exception)
        if status in _CODES:
            s.set_status(Status(_CODES[status], message if status == "error" else None))
        s.end()


class SystemIdGenerator(IdGenerator):
    """Ids from the OS's randomness, as the embedded tracer's (spans.new_span_id). The SDK's RandomIdGenerator draws
    from the global `random` module: an agent that seeds it repeats its span ids, and the store, which keeps one span
    per (rollout_id, span_id), drops a retried attempt's spans as duplicates."""

    _random = random.SystemRandom()

    def generate_span_id(self) -> int:
        return self._random.getrandbits(64) or 1

    def generate_trace_id(self) -> int:
        return self._random.getrandbits(128) or 1

    def is_trace_id_random(self) -> bool:
        return True


def _use_system_ids(provider: TracerProvider) -> None:
    """Replace the SDK's default id generator (one a framework chose on purpose stays), also on the tracers the
    provider already made (the SDK caches them): each keeps the generator it was made with."""
    if type(provider.id_generator) is RandomIdGenerator:
        provider.id_generator = SystemIdGenerator()
        for tracer in list(getattr(provider, "_tracers", {}).values()):
            if type(getattr(tracer, "id_generator", None)) is RandomIdGenerator:
                tracer.id_generator = provider.id_generator


_provider: TracerProvider | None = None
_provider_lock = threading.Lock()


def setup_otel(sink: Sink | None = None, provider: TracerProvider | None = None) -> TracerProvider:
    """Once per process (a worker calls it at start; `trace_attempt(backend="otel")` calls it if nobody did).

    Adds an AttemptSpanProcessor to `provider`, else to the global SDK provider an agent framework already set, else
    to a new one made global. `sink` receives the spans that end outside any traced attempt (None: they are not
    kept). Later calls return the same provider and change nothing: OpenTelemetry has one global provider."""
    global _provider
    with _provider_lock:
        if _provider is None:
            if provider is None:
                provider = trace.get_tracer_provider()
                if not isinstance(provider, TracerProvider):
                    provider = TracerProvider(span_limits=_UNLIMITED)
                    trace.set_tracer_provider(provider)
            _use_system_ids(provider)
            fallback = BatchSpanProcessor(SinkSpanExporter(sink)) if sink is not None else None
            provider.add_span_processor(AttemptSpanProcessor(fallback))
            # each request made under an agent span names the agent (serving/adapters.py: its adapter serves it)
            agents = AgentSpans()
            provider.add_span_processor(agents)
            propagate.set_global_textmap(CompositePropagator([propagate.get_global_textmap(), AgentHeader(agents)]))
            _provider = provider
        return _provider
