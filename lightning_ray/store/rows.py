"""How spans, rollouts and attempts sit in the store's rows (store/sqlite.py) and travel as them to and from the
store's actor: built and read by the callers, so the single store process spends its CPU on neither JSON nor models.
"""

from __future__ import annotations

import math
import struct
from functools import lru_cache

import msgspec
import numpy as np

from lightning_ray.types import Attempt, AttemptPolicy, Rollout, Span, SpanEvent, Task

SPAN_STATUSES = ("unset", "ok", "error")


def _json_safe(value):
    if isinstance(value, (np.ndarray, np.generic)):  # arrays not packed (2-d, bools, ...), numpy scalars
        return value.tolist()
    raise NotImplementedError(f"cannot store a {type(value).__name__} as JSON")


_json = msgspec.json.Encoder(enc_hook=_json_safe)
_msgpack = msgspec.msgpack.Encoder()
_decode_arrays = msgspec.msgpack.Decoder(list[tuple[str, str, bytes]]).decode
# Packed arrays are little-endian, so that a file reads the same on any machine.
_DTYPES = {"i": np.dtype("<i4"), "q": np.dtype("<i8"), "d": np.dtype("<f8")}
_INT32 = np.iinfo(np.int32)


def span_row(s: Span) -> tuple:
    """The wire and storage form of a span; built by the sender so the store does not spend its CPU on JSON."""
    attributes, arrays = _pack(s.attributes)
    return (s.span_id, s.trace_id, s.parent_id, s.rollout_id, s.attempt_id, s.name, s.start_time, s.end_time,
            s.status, s.status_message, _json.encode(attributes),
            _json.encode([e.model_dump() for e in s.events]) if s.events else b"[]", arrays)


def _pack(attributes: dict) -> tuple[dict, bytes | None]:
    """Attributes that are lists of plain ints or floats (token ids, logprobs: most of an LLM call's bytes), or 1-d
    numpy arrays of ints or floats (a span read back from the store), leave the JSON as packed arrays, which read back
    as numpy arrays without parsing a number, and exactly; a null keeps the key's place."""
    packed = []
    for key, value in attributes.items():
        if isinstance(value, np.ndarray):
            if (code := _code(value)) is not None:
                packed.append((key, code, value.astype(_DTYPES[code], copy=False).tobytes()))
            continue
        if type(value) is not list or not value:
            continue
        if type(value[0]) is int:
            try:  # strict: a bool or a float among them is an error, not converted
                value, codes = msgspec.convert(value, list[int]), ("i", "q")  # int32 if all fit, else int64
            except msgspec.ValidationError:
                continue
        elif set(map(type, value)) == {float}:
            codes = ("d",)
        else:
            continue
        for code in codes:
            try:
                packed.append((key, code, struct.pack(f"<{len(value)}{code}", *value)))  # 3x faster than array's
                break
            except struct.error:  # out of range (beyond int64 it stays JSON)
                pass
    if not packed:
        return attributes, None
    return {**attributes, **dict.fromkeys(k for k, _, _ in packed)}, _msgpack.encode(packed)


def _code(a: np.ndarray) -> str | None:
    """Which packed dtype an array is stored as (ints as int32 where they fit, as lists are), or None: left to JSON."""
    if a.ndim != 1 or a.dtype.kind not in "iuf":
        return None
    if a.dtype.kind == "f" or not a.size:
        return "d" if a.dtype.kind == "f" else "i"
    if _INT32.min <= a.min() and a.max() <= _INT32.max:
        return "i"
    return "q" if a.max() <= np.iinfo(np.int64).max else None


def span_from_row(r: tuple) -> Span:
    """Packed lists come back as read-only numpy arrays over the row's bytes (no list of Python numbers is made)."""
    attributes = msgspec.json.decode(r[10])
    if r[12] is not None:
        for key, code, raw in _decode_arrays(r[12]):
            attributes[key] = np.frombuffer(raw, _DTYPES[code])
    return Span(span_id=r[0], trace_id=r[1], parent_id=r[2], rollout_id=r[3], attempt_id=r[4], name=r[5],
                start_time=r[6], end_time=r[7], status=r[8], status_message=r[9], attributes=attributes,
                events=[SpanEvent(**e) for e in msgspec.json.decode(r[11])] if r[11] != b"[]" else [], origin=r[13])


def _time(x) -> bool:
    # NaN would be stored as NULL: the NOT NULL violation is swallowed by INSERT OR IGNORE, and the span vanishes,
    # counted as a duplicate. An int beyond int64 would fail the whole batch's insert.
    return isinstance(x, float) and math.isfinite(x) or isinstance(x, int) and -2**63 <= x < 2**63


def row_problem(r) -> str | None:
    """Why a span row cannot be stored, or None. Cheap: only what SQLite and readers rely on."""
    if not isinstance(r, (tuple, list)) or len(r) != 13:
        return "not a span row"
    if not (isinstance(r[0], str) and r[0]) or not (isinstance(r[5], str) and r[5]):
        return "span_id and name must be non-empty strings"
    if not _time(r[6]) or (r[7] is not None and (not _time(r[7]) or r[7] < r[6])):
        return "start_time must be a finite number and end_time, if set, one not before it"
    if r[8] not in SPAN_STATUSES:
        return f"status must be one of {SPAN_STATUSES}"
    if not all(v is None or isinstance(v, str) for v in (r[1], r[2], r[3], r[4], r[9])):
        return "ids and status_message must be strings"
    if not (isinstance(r[10], bytes) and isinstance(r[11], bytes)):
        return "attributes and events must be encoded JSON"
    if not (r[12] is None or isinstance(r[12], bytes)):
        return "packed arrays must be bytes or None"
    return None


def rollout_row(r: Rollout) -> tuple:
    """A rollout as its row in sqlite.py's rollouts table holds it (task and attempt policy as JSON), which is also
    how rollouts travel to and from the store's actor: Ray pickles plain values ~8x faster than the models
    (benchmarks/README.md), and the store's one thread is what bounds rollouts/s."""
    return (r.rollout_id, r.task.model_dump_json(), r.config.model_dump_json(), r.status, r.attempt_id, r.attempts,
            r.reward, r.error, r.enqueued_at, r.ended_at, r.queue)


def rollout_of(r: tuple) -> Rollout:
    return Rollout(rollout_id=r[0], task=Task.model_validate_json(r[1]), config=AttemptPolicy.model_validate_json(r[2]),
                   status=r[3], attempt_id=r[4], attempts=r[5], reward=r[6], error=r[7], enqueued_at=r[8],
                   ended_at=r[9], queue=r[10])


def attempt_of(r) -> Attempt:
    return Attempt(attempt_id=r[0], rollout_id=r[1], sequence=r[2], status=r[3], worker_id=r[4], started_at=r[5],
                   last_heartbeat=r[6], ended_at=r[7], error=r[8])


def attempt_row(a: Attempt) -> tuple:
    return (a.attempt_id, a.rollout_id, a.sequence, a.status, a.worker_id, a.started_at, a.last_heartbeat,
            a.ended_at, a.error)


@lru_cache(maxsize=64)
def attempt_policy(text: str) -> AttemptPolicy:
    """An attempt policy from its JSON, parsed once: a run's rollouts share one (read here, never handed out)."""
    return AttemptPolicy.model_validate_json(text)
