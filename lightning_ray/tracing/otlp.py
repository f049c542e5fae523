"""The OTLP/HTTP path: an `ExportTraceServiceRequest` body, in protobuf or OTLP JSON, becomes our Spans.

The result equals what `otel.span_from_otel` gives for the same SDK spans: ids as lowercase hex, times in float
seconds, AnyValue as Python (arrays as lists, kvlists as dicts, bytes as bytes), resource attributes and
rollout/attempt ids as in `spans.make_span`. Links, span kind, scopes and dropped counts are not kept.

JSON is decoded directly rather than through `google.protobuf.json_format` (~25x slower on token-id arrays), as
the OTLP spec defines it: lowerCamelCase keys, hex trace/span ids, int64 as strings or numbers, enums as integers.
What `json_format.MessageToJson` writes is accepted too (base64 ids, enum names).
"""

from __future__ import annotations

import base64
import binascii
import re
import struct
from operator import attrgetter
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from lightning_ray.tracing.spans import ResourceInfo, make_span
from lightning_ray.types import Span, SpanEvent

try:
    from orjson import loads as _json_loads  # ~2x the stdlib on OTLP JSON; optional
except ImportError:  # pragma: no cover
    from json import loads as _json_loads

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
_MEDIA = {PROTOBUF: "protobuf", "application/protobuf": "protobuf", JSON: "json"}


class OtlpDecodeError(ValueError):
    """The body is not a valid OTLP trace export (a receiver answers 400)."""


class UnsupportedContentType(OtlpDecodeError):
    """Neither OTLP protobuf nor OTLP JSON (a receiver answers 415)."""


def spans_from_otlp(body: bytes, content_type: str) -> list[Span]:
    """Decode an OTLP/HTTP trace export body (already decompressed). Raises OtlpDecodeError naming the first
    problem, e.g. `resourceSpans[0].scopeSpans[0].spans[3]: endTimeUnixNano is before startTimeUnixNano`."""
    media = _MEDIA.get((content_type or "").partition(";")[0].strip().lower())
    if media is None:
        raise UnsupportedContentType(f"unsupported content type {content_type!r}: OTLP/HTTP sends {PROTOBUF} or {JSON}")
    if media == "protobuf":
        try:
            request = ExportTraceServiceRequest.FromString(body)
        except DecodeError as e:
            raise OtlpDecodeError(f"body is not an OTLP ExportTraceServiceRequest in protobuf: {e}") from None
        return _walk(request.resource_spans, _protobuf_resource, _protobuf_span, "resource", "scope_spans", "spans")
    try:
        request = _json_loads(body)
    except ValueError as e:
        raise OtlpDecodeError(f"body is not valid JSON: {e}") from None
    if not isinstance(request, dict):
        raise OtlpDecodeError(f"an OTLP JSON export is an object with resourceSpans, not {type(request).__name__}")
    return _walk(_list(request.get("resourceSpans")), _json_resource, _json_span, "resource", "scopeSpans", "spans")


def _walk(resource_spans, resource_of, span_of, resource_key: str, scopes_key: str, spans_key: str) -> list[Span]:
    """The request's resource → scope → span tree, flattened; an error names where it happened."""
    out: list[Span] = []
    i = j = k = None
    try:
        for i, rs in enumerate(resource_spans):
            j = k = None
            resource = resource_of(_get(rs, resource_key))
            for j, ss in enumerate(_get_list(rs, scopes_key)):
                for k, s in enumerate(_get_list(ss, spans_key)):
                    out.append(span_of(s, resource))
                k = None
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError, binascii.Error) as e:
        where = "".join(f"{name}[{n}]" for name, n in (("resourceSpans", i), (".scopeSpans", j), (".spans", k))
                        if n is not None) or "request"
        detail = str(e) if isinstance(e, OtlpDecodeError) else f"malformed ({type(e).__name__}: {e})"
        raise OtlpDecodeError(f"{where}: {detail}") from None
    return out


def _get(message, key: str):
    return message.get(key) if isinstance(message, dict) else getattr(message, key)


def _get_list(message, key: str):
    return _list(message.get(key)) if isinstance(message, dict) else getattr(message, key)


def _list(value) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise OtlpDecodeError(f"expected a list, got {type(value).__name__}")
    return value


def _hex_id(raw: bytes, size: int, name: str) -> str:
    if len(raw) != size or raw.count(0) == size:
        raise OtlpDecodeError(f"{name} must be {size} bytes, not all zero; got {raw.hex() or 'nothing'}")
    return raw.hex()


_NO_PARENT = (b"", bytes(8))


def _parent_id(raw: bytes) -> str | None:
    # All zeros is no parent, as the OTel Collector reads it (some exporters send it for a root span).
    return None if raw in _NO_PARENT else _hex_id(raw, 8, "parentSpanId")


def _times(start: int, end: int) -> tuple[float, float]:
    if start <= 0 or end <= 0:
        raise OtlpDecodeError(f"{'startTimeUnixNano' if start <= 0 else 'endTimeUnixNano'} is missing")
    if end < start:
        raise OtlpDecodeError("endTimeUnixNano is before startTimeUnixNano")
    return start / 1e9, end / 1e9


_STATUS_CODES = {0: "unset", 1: "ok", 2: "error",
                 "STATUS_CODE_UNSET": "unset", "STATUS_CODE_OK": "ok", "STATUS_CODE_ERROR": "error"}


def _status(code) -> str:
    status = _STATUS_CODES.get(code)
    if status is None:
        raise OtlpDecodeError(f"unknown status code {code!r}")
    return status


# Protobuf.

def _protobuf_resource(resource) -> ResourceInfo:
    return ResourceInfo.of(_pb_attributes(resource.attributes)) if resource.attributes else ResourceInfo()


def _protobuf_span(s, resource: ResourceInfo) -> Span:
    status = s.status
    return make_span(
        _hex_id(s.trace_id, 16, "traceId"), _hex_id(s.span_id, 8, "spanId"),
        _parent_id(s.parent_span_id),
        s.name, *_times(s.start_time_unix_nano, s.end_time_unix_nano), _status(status.code), status.message,
        _pb_attributes(s.attributes),
        [SpanEvent(name=e.name, time=e.time_unix_nano / 1e9, attributes=_pb_attributes(e.attributes))
         for e in s.events],
        resource,
    )


def _pb_attributes(key_values) -> dict[str, Any]:
    return {kv.key: _pb_value(kv.value) for kv in key_values}


def _pb_value(value) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return _pb_array(value.array_value)
    if kind == "kvlist_value":
        return _pb_attributes(value.kvlist_value.values)
    return None if kind is None else getattr(value, kind)


_PB_GETTERS = {kind: attrgetter(kind) for kind in ("string_value", "bool_value", "int_value", "double_value")}


def _pb_array(array) -> list:
    values = array.values
    if not values:
        return []
    kind = values[0].WhichOneof("value")
    if len(values) >= 16:  # token ids and logprobs: decoded from the array's bytes in C, ~5x faster
        out = _int_array(array, len(values)) if kind == "int_value" else (
            _double_array(array, len(values)) if kind == "double_value" else None)
        if out is not None:
            return out
    getter = _PB_GETTERS.get(kind)
    if getter is not None:  # one getter instead of a WhichOneof per element
        out = list(map(getter, values))
        # An element of another kind reads as this kind's default (0, "", False): only those need a second look.
        if all(out) or all(x or values[n].WhichOneof("value") == kind for n, x in enumerate(out)):
            return out
    return [_pb_value(v) for v in values]


# Reading a long array element by element costs ~0.15 µs per element. Encoded canonically (as every OTLP exporter
# does), an int element is `0a LEN 18 <varint>` and a double element `0a 09 21 <8 bytes>`, so both kinds can be
# decoded from the ArrayValue's bytes at C speed and then checked against the element count.

def _packed_varints() -> type:
    """A message whose field 1 is `repeated int64`: it reads the ArrayValue's element records as packed varints."""
    f = descriptor_pb2.FileDescriptorProto(name="lightning_ray/otlp_packed.proto", package="lightning_ray.otlp")
    f.message_type.add(name="PackedVarints").field.add(
        name="values", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_INT64,
        label=descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("lightning_ray.otlp.PackedVarints"))


_PackedVarints = _packed_varints()
_DOUBLES = re.compile(rb"(?:\x0a\x09\x21.{8})*", re.DOTALL)


def _int_array(array, n: int) -> list[int] | None:
    # Each int element reads as the pair [24 (its tag), value]. Any other element starts with another tag, and an
    # empty one (None) breaks the count: exactly n pairs all tagged 24 means n ints.
    try:
        flat = _PackedVarints.FromString(array.SerializeToString()).values[:]
    except DecodeError:
        return None
    return flat[1::2] if len(flat) == 2 * n and flat[0::2].count(24) == n else None


def _double_array(array, n: int) -> list[float] | None:
    raw = array.SerializeToString()
    if len(raw) == 11 * n and _DOUBLES.fullmatch(raw):
        return list(struct.unpack("<" + "3xd" * n, raw))
    return None


# JSON.

def _json_resource(resource) -> ResourceInfo:
    attributes = (resource or {}).get("attributes")
    return ResourceInfo.of(_json_attributes(attributes)) if attributes else ResourceInfo()


def _json_span(s: dict, resource: ResourceInfo) -> Span:
    status = s.get("status") or {}
    parent = s.get("parentSpanId")
    return make_span(
        _json_id(s.get("traceId"), 16, "traceId"), _json_id(s.get("spanId"), 8, "spanId"),
        _parent_id(_json_bytes(parent, 8, "parentSpanId")) if parent else None,
        _str(s.get("name", "")),
        *_times(_nanos(s.get("startTimeUnixNano", 0), "startTimeUnixNano"),
                _nanos(s.get("endTimeUnixNano", 0), "endTimeUnixNano")),
        _status(status.get("code", 0)), _str(status.get("message", "")),
        _json_attributes(s.get("attributes")),
        [SpanEvent(name=_str(e.get("name", "")), time=_nanos(e.get("timeUnixNano", 0), "timeUnixNano") / 1e9,
                   attributes=_json_attributes(e.get("attributes"))) for e in _list(s.get("events"))],
        resource,
    )


def _json_id(value, size: int, name: str) -> str:
    return _hex_id(_json_bytes(value, size, name), size, name)


def _json_bytes(value, size: int, name: str) -> bytes:
    if not isinstance(value, str) or not value:
        raise OtlpDecodeError(f"{name} is missing")
    # OTLP JSON writes ids in hex; the plain protobuf JSON mapping (MessageToJson) in base64. Lengths tell them apart.
    return bytes.fromhex(value) if len(value) == 2 * size else base64.b64decode(value, validate=True)


def _nanos(value, name: str) -> int:
    # A fixed64 in the protobuf: bounded here too, or a huge one fails the conversion to float seconds.
    n = int(value)
    if not 0 <= n < 2**64:
        raise OtlpDecodeError(f"{name} is out of range: not a uint64 of nanoseconds")
    return n


def _json_attributes(key_values) -> dict[str, Any]:
    return {_str(kv["key"]): _json_value(kv.get("value")) for kv in _list(key_values)}


def _json_value(value) -> Any:
    if not value:
        return None  # an empty AnyValue
    if len(value) != 1:
        raise OtlpDecodeError(f"an AnyValue holds one value, got {sorted(value)}")
    (kind, x), = value.items()
    if kind == "arrayValue":
        return _json_array(_list((x or {}).get("values")))
    if kind == "kvlistValue":
        return _json_attributes((x or {}).get("values"))
    convert = _JSON_SCALARS.get(kind)
    if convert is None:
        raise OtlpDecodeError(f"unknown AnyValue kind {kind!r}")
    return convert(x)


def _json_array(values: list) -> list:
    if values and isinstance(values[0], dict) and len(values[0]) == 1:
        kind = next(iter(values[0]))
        convert = _JSON_SCALARS.get(kind)
        if convert is not None:
            try:  # the common homogeneous array (token ids) in one comprehension
                return [convert(v[kind]) for v in values]
            except (KeyError, TypeError):
                pass  # mixed kinds: element by element
    return [_json_value(v) for v in values]


def _str(x) -> str:
    if type(x) is not str:
        raise OtlpDecodeError(f"expected a string, got {x!r}")
    return x


def _bool(x) -> bool:
    if type(x) is not bool:
        raise OtlpDecodeError(f"expected true or false, got {x!r}")
    return x


def _int(x) -> int:
    if type(x) is bool or isinstance(x, float):
        raise OtlpDecodeError(f"expected an integer, got {x!r}")
    return int(x)  # int64 arrives as a string ("42"), or as a number from lenient writers


def _bytes(x) -> bytes:
    return base64.b64decode(_str(x), validate=True)


_JSON_SCALARS = {"stringValue": _str, "boolValue": _bool, "intValue": _int, "doubleValue": float, "bytesValue": _bytes}
