"""What every tracing path shares to build the same `Span`: attribute values, attribution, the exception event.

The embedded tracer, the OpenTelemetry exporter and the OTLP receiver all end in `make_span`, and attribute values
follow the OpenTelemetry SDK's rules (`opentelemetry.attributes`), so one agent run gives equal spans on every path.
"""

from __future__ import annotations

import random
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_ray.tracing import semconv
from lightning_ray.types import Span, SpanEvent

_SCALARS = frozenset({str, int, float, bool, bytes, type(None)})
_STR = frozenset({str})


def clean_attributes(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """A new dict of valid attribute values: what the OpenTelemetry SDK would keep, with sequences as lists.

    Cheap when values are already clean (the SDK's own dicts): one comprehension, one type lookup per value."""
    out = {k: v if type(v) in _SCALARS else attribute_value(v) for k, v in attributes.items()}
    if "" in out or not _STR.issuperset(map(type, out)):
        out = {key: v for k, v in out.items() if (key := _key(k))}
    return out


def attribute_value(value: Any) -> Any:
    """One value as the SDK cleans it: scalars and None as they are, sequences (lists here, tuples in the SDK) and
    mappings recursively, anything else as its str() (None if it has no readable one)."""
    t = type(value)
    if t in _SCALARS:
        return value
    if t is list or t is tuple:
        return _sequence(value)
    if isinstance(value, (bool, int, float, bytes, str)):  # subclasses, e.g. numpy.float64
        return value
    if isinstance(value, Sequence):
        return _sequence(value)
    if isinstance(value, Mapping):
        return clean_attributes(value)
    return str(value) if _readable(value) else None


def _sequence(values: Sequence) -> list:
    try:
        # A C-speed proof that every element is a plain number (token ids, logprobs): nothing nested to clean.
        if isinstance(sum(values), (int, float)):
            return list(values)
    except (TypeError, OverflowError):
        pass
    return [attribute_value(v) for v in values]


def _key(key: Any) -> str | None:
    if not key:
        return None
    return key if isinstance(key, str) else str(key) if _readable(key) else None


def _readable(value: Any) -> bool:
    # The SDK's rule: str() is used only where the type defines a __str__ or __repr__ of its own.
    return type(value).__str__ is not object.__str__ or type(value).__repr__ is not object.__repr__


def exception_attributes(exc: BaseException, escaped: bool = False) -> dict[str, Any]:
    """The attributes of OpenTelemetry's `exception` event, as the SDK's `record_exception` writes them."""
    return {
        semconv.EXCEPTION_TYPE: exception_type(exc),
        semconv.EXCEPTION_MESSAGE: str(exc),
        semconv.EXCEPTION_STACKTRACE: "".join(traceback.format_exception(exc)),
        semconv.EXCEPTION_ESCAPED: str(escaped),
    }


def exception_type(exc: BaseException) -> str:
    """The exception's fully qualified class name (builtins unqualified), as OpenTelemetry writes it."""
    module, name = type(exc).__module__, type(exc).__qualname__
    return f"{module}.{name}" if module and module != "builtins" else name


# The OS's randomness, not the `random` module's global generator: an agent that seeds `random` for each task
# would otherwise give its spans the same ids in every rollout (and forked workers would share one sequence).
_IDS = random.SystemRandom()


def new_trace_id() -> str:
    """32 hex chars, like OpenTelemetry's (a random non-zero 128-bit id)."""
    return f"{_IDS.getrandbits(128) or 1:032x}"


def new_span_id() -> str:
    """16 hex chars, like OpenTelemetry's (a random non-zero 64-bit id)."""
    return f"{_IDS.getrandbits(64) or 1:016x}"


@dataclass(frozen=True)
class ResourceInfo:
    """What a span takes from its resource: the RESOURCE_KEYS attributes and fallback rollout/attempt ids.
    Built once per resource, not per span."""

    attributes: dict[str, Any] = field(default_factory=dict)
    rollout_id: str | None = None
    attempt_id: str | None = None

    @classmethod
    def of(cls, attributes: Mapping[str, Any]) -> ResourceInfo:
        kept = {k: attribute_value(attributes[k]) for k in semconv.RESOURCE_KEYS if k in attributes}
        # "unknown_service…" is the SDK's placeholder when nobody named the service: it tells nothing.
        if str(kept.get(semconv.SERVICE_NAME, "")).startswith("unknown_service"):
            del kept[semconv.SERVICE_NAME]
        return cls(kept, _str(attributes.get(semconv.ROLLOUT_ID)), _str(attributes.get(semconv.ATTEMPT_ID)))


NO_RESOURCE = ResourceInfo()


def make_span(
    trace_id: str,
    span_id: str,
    parent_id: str | None,
    name: str,
    start_time: float,
    end_time: float | None,
    status: str,
    status_message: str | None,
    attributes: dict[str, Any],
    events: list[SpanEvent],
    resource: ResourceInfo = NO_RESOURCE,
) -> Span:
    """Our Span from the parts every source has. Takes ownership of `attributes` (the ids are moved out of it)."""
    rollout_id = _str(attributes.pop(semconv.ROLLOUT_ID, None)) or resource.rollout_id
    attempt_id = _str(attributes.pop(semconv.ATTEMPT_ID, None)) or resource.attempt_id
    if resource.attributes:
        attributes = {**resource.attributes, **attributes}
    if semconv.AGENT_NAME not in attributes:
        for alias in semconv.AGENT_NAME_ALIASES:
            if alias in attributes:
                attributes[semconv.AGENT_NAME] = attributes[alias]
                break
    return Span(
        span_id=span_id, trace_id=trace_id, parent_id=parent_id, rollout_id=rollout_id, attempt_id=attempt_id,
        name=name, start_time=start_time, end_time=end_time, status=status, status_message=status_message or None,
        attributes=attributes, events=events,
    )


def _str(value: Any) -> str | None:
    return None if value is None or value == "" else str(value)
