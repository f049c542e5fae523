"""The rollout and attempt lifecycles: every state change the store makes is checked against these tables."""

from __future__ import annotations

from lightning_ray.store.errors import InvalidTransition

ROLLOUT_MOVES: dict[str, set[str]] = {
    "queued": {"running", "cancelled"},
    "requeued": {"running", "cancelled"},
    "running": {"succeeded", "failed", "requeued", "cancelled"},
}
ATTEMPT_MOVES: dict[str, set[str]] = {
    "running": {"succeeded", "failed", "timeout", "unresponsive"},
}


def check_move(kind: str, name: str, old: str, new: str) -> None:
    moves = ROLLOUT_MOVES if kind == "rollout" else ATTEMPT_MOVES
    if new not in moves.get(old, ()):
        raise InvalidTransition(f"{kind} {name} cannot go from {old!r} to {new!r}")
