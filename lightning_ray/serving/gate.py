"""Pause and resume around a weight update: while paused, new requests wait (they are held, not refused);
requests already generating finish first; nothing is dropped — unless a generation outlives the drain deadline,
then it is ended with `DrainTimeout` so a stuck one cannot hold the policy back forever."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager


class DrainTimeout(Exception):
    """A generation ended by the gate: a weight update waited the whole drain deadline for it."""


class Gate:
    def __init__(self, drain_timeout_s: float = 60.0):
        self.drain_timeout_s = drain_timeout_s
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._admitted: set[asyncio.Task] = set()
        self._ended: set[asyncio.Task] = set()  # cancelled by the drain deadline
        self._pauses = 0  # nested pauses (a sleeping engine's, then a weight load's): the last one out reopens

    @property
    def is_paused(self) -> bool:
        return not self._open.is_set()

    @property
    def in_flight(self) -> int:
        return len(self._admitted)

    @asynccontextmanager
    async def admit(self):
        await self._open.wait()
        task = asyncio.current_task()
        self._admitted.add(task)
        self._idle.clear()
        try:
            yield
        except asyncio.CancelledError:
            if task not in self._ended:
                raise
            task.uncancel()  # our cancellation, not the caller's: report it as the error it is
            raise DrainTimeout(f"ended after {self.drain_timeout_s:g} s: a policy weight update was waiting for this "
                               f"generation to finish; retry the request") from None
        finally:
            self._admitted.discard(task)
            self._ended.discard(task)
            if not self._admitted:
                self._idle.set()

    @asynccontextmanager
    async def paused(self):
        """Close the gate, wait for in-flight requests to drain (ending those past the deadline), run the body,
        reopen."""
        self._open.clear()
        self._pauses += 1
        try:
            try:
                await asyncio.wait_for(self._idle.wait(), self.drain_timeout_s)
            except asyncio.TimeoutError:
                for task in self._admitted - self._ended:
                    self._ended.add(task)
                    task.cancel()
                await self._idle.wait()  # a cancelled generation ends at its next await
            yield
        finally:
            self._pauses -= 1
            if not self._pauses:
                self._open.set()
