"""A multi-turn episode's prompt ids stored once.

Each call of an agent's episode is sent the whole conversation so far: its prompt is the previous call's prompt and
completion, then what came between (a tool's result, the next user turn). Stored as sent, an episode of T turns
keeps T copies of its opening, quadratic in its turns. So the store keeps a call's prompt ids as the tail that
follows an earlier call's prompt and completion, naming that call (the row's `prompt_base`), and puts them back
together on the way out: readers see every prompt whole.

Which earlier call: the last few calls of the same rollout the store has taken in (remembered by a digest, not their
ids), checked exactly, so a prompt that extends none of them (a retried attempt, a rewritten history, a store that
restarted) is stored whole. Rows are the store's (rows.span_row); packed arrays are little-endian bytes, so a
prefix is a bytes prefix and a prompt is put back together by concatenation, without decoding a number.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Callable

import msgspec

from lightning_ray.tracing.semconv import COMPLETION_TOKEN_IDS, PROMPT_TOKEN_IDS

_decode = msgspec.msgpack.Decoder(list[tuple[str, str, bytes]]).decode
_encode = msgspec.msgpack.Encoder().encode
ARRAYS, ROLLOUT_ID, SPAN_ID = 12, 3, 0  # row columns (sqlite._SPAN_COLS)


def _digest(raw: bytes) -> bytes:
    return hashlib.blake2b(raw, digest_size=16).digest()


def _ids(arrays: list[tuple[str, str, bytes]]) -> tuple[tuple[str, bytes] | None, tuple[str, bytes] | None]:
    """(code, bytes) of the prompt ids and of the completion ids, each None when not packed."""
    found = {key: (code, raw) for key, code, raw in arrays if key in (PROMPT_TOKEN_IDS, COMPLETION_TOKEN_IDS)}
    return found.get(PROMPT_TOKEN_IDS), found.get(COMPLETION_TOKEN_IDS)


def _replace_prompt(arrays: list[tuple[str, str, bytes]], raw: bytes) -> bytes:
    return _encode([(key, code, raw if key == PROMPT_TOKEN_IDS else value) for key, code, value in arrays])


class PromptChain:
    """Remembers the last `per_rollout` calls of the last `rollouts` rollouts the store took in."""

    def __init__(self, rollouts: int = 4096, per_rollout: int = 4):
        self.rollouts, self.per_rollout = rollouts, per_rollout
        # rollout_id -> (span_id, code, length in bytes, digest of prompt + completion bytes), newest last
        self._calls: OrderedDict[str, deque[tuple[str, str, int, bytes]]] = OrderedDict()

    def shorten(self, row: tuple) -> tuple[tuple, str | None]:
        """(the row to store, the span id its prompt extends or None). Call in the order rows are inserted, and
        only for rows that will be (a base must be in the file, or in the same insert, by the time it is named)."""
        if row[ROLLOUT_ID] is None or row[ARRAYS] is None:
            return row, None
        arrays = _decode(row[ARRAYS])
        prompt, completion = _ids(arrays)
        if prompt is None:
            return row, None
        code, raw = prompt
        base = next((c for c in reversed(self._calls.get(row[ROLLOUT_ID], ())) if c[1] == code and
                     c[2] <= len(raw) and _digest(raw[:c[2]]) == c[3] and c[0] != row[SPAN_ID]), None)
        if completion is not None and completion[0] == code:
            whole = raw + completion[1]
            calls = self._calls.setdefault(row[ROLLOUT_ID], deque(maxlen=self.per_rollout))
            calls.append((row[SPAN_ID], code, len(whole), _digest(whole)))
            self._calls.move_to_end(row[ROLLOUT_ID])
            while len(self._calls) > self.rollouts:
                self._calls.popitem(last=False)
        if base is None:
            return row, None
        return (*row[:ARRAYS], _replace_prompt(arrays, raw[base[2]:]), *row[ARRAYS + 1:]), base[0]

    def forget(self) -> None:
        """After spans were deleted: a remembered call may be gone."""
        self._calls.clear()


def restore(rows: list[tuple], bases: list[str | None], fetch: Callable[[str, str], tuple[tuple, str | None]]
            ) -> list[tuple]:
    """The rows with every shortened prompt whole again. `bases[i]` is rows[i]'s prompt_base; `fetch(rollout_id,
    span_id)` reads a base that is not among the rows, as (row, its prompt_base)."""
    if not any(bases):
        return rows
    known = {(r[ROLLOUT_ID], r[SPAN_ID]): (r, b) for r, b in zip(rows, bases)}
    calls: dict[tuple[str, str], tuple[bytes, bytes]] = {}  # (rollout_id, span_id) -> whole prompt, completion

    def whole(row: tuple, base: str | None) -> tuple[bytes, bytes]:
        chain = []  # this call, the call it extends, ... back to one stored whole or already put together
        while (row[ROLLOUT_ID], row[SPAN_ID]) not in calls:
            chain.append(row)
            if base is None:
                break
            key = (row[ROLLOUT_ID], base)
            row, base = known[key] if key in known else known.setdefault(key, fetch(*key))
        before = b"".join(calls.get((row[ROLLOUT_ID], row[SPAN_ID]), ()))  # the extended call's prompt + completion
        for r in reversed(chain):
            p, c = _ids(_decode(r[ARRAYS]))
            calls[r[ROLLOUT_ID], r[SPAN_ID]] = (before + p[1], c[1] if c is not None else b"")
            before = b"".join(calls[r[ROLLOUT_ID], r[SPAN_ID]])
        return calls[chain[0][ROLLOUT_ID], chain[0][SPAN_ID]] if chain else calls[row[ROLLOUT_ID], row[SPAN_ID]]

    return [r if b is None else (*r[:ARRAYS], _replace_prompt(_decode(r[ARRAYS]), whole(r, b)[0]), *r[ARRAYS + 1:])
            for r, b in zip(rows, bases)]
