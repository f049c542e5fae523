"""The calling agent's name on every HTTP request made under an agent span: the `x-lightning-ray-agent` header, by
which the policy server serves each agent's calls with its own adapter (serving/adapters.py).

OpenTelemetry's HTTP client instrumentations inject the global propagator's fields into each request they send
(the W3C traceparent, baggage); setup_otel adds AgentHeader to them, with AgentSpans, a span processor that keeps,
for each span open in the process, the agent it runs under (the nearest one naming an agent: itself, its parent,
...). The server needs the agent when the call arrives, and the spans that name it end, and reach the store, only
after: the header carries it. A request made under no agent span gets no header. The name is percent-encoded where
HTTP cannot carry it as it is (non-ASCII, control characters, '%', spaces at its ends); the server unquotes it.
"""

from __future__ import annotations

import string
from urllib.parse import quote

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import CarrierT, Getter, Setter, TextMapPropagator, default_getter, \
    default_setter
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace import Span as SdkSpan

from lightning_ray.algorithm.select import agent_named
from lightning_ray.tracing.semconv import AGENT_HEADER


# Printable ASCII but '%' stays as it is, so an ASCII name is sent unchanged. Anything else is percent-encoded as UTF-8:
# header values are bytes that servers decode as latin-1 (Starlette), and http.client refuses what latin-1 cannot hold.
_SAFE = string.punctuation.replace("%", "") + " "


def header_value(name: str) -> str:
    """The agent's name as the header carries it (serving/http.py's trace_ids unquotes it)."""
    value = quote(name, safe=_SAFE)
    if value[:1] == " " or value[-1:] == " ":  # HTTP strips a value's outer spaces (h11 refuses them): encode them
        value = quote(name, safe=_SAFE.replace(" ", ""))
    return value


class AgentSpans(SpanProcessor):
    """span id -> agent name, for the process's open spans under an agent (bounded by them: each leaves as it ends)."""

    def __init__(self):
        self.agents: dict[int, str] = {}

    def on_start(self, span: SdkSpan, parent_context: Context | None = None) -> None:
        name = agent_named(span.name, span.attributes or {})
        if name is None and span.parent is not None:
            name = self.agents.get(span.parent.span_id)
        if name is not None:
            self.agents[span.context.span_id] = name

    def on_end(self, span: ReadableSpan) -> None:
        self.agents.pop(span.context.span_id, None)


class AgentHeader(TextMapPropagator):
    def __init__(self, spans: AgentSpans):
        self.spans = spans

    def inject(self, carrier: CarrierT, context: Context | None = None, setter: Setter = default_setter) -> None:
        if name := self.spans.agents.get(trace.get_current_span(context).get_span_context().span_id):
            setter.set(carrier, AGENT_HEADER, header_value(name))

    def extract(self, carrier: CarrierT, context: Context | None = None, getter: Getter = default_getter) -> Context:
        return context if context is not None else Context()  # the server reads the header itself

    @property
    def fields(self) -> set[str]:
        return {AGENT_HEADER}
