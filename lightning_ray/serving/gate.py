"""Pause and resume around a weight update: while paused, new requests wait (they are held, not refused);
requests already generating finish first; nothing is dropped."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager


class Gate:
    def __init__(self):
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.in_flight = 0

    @property
    def is_paused(self) -> bool:
        return not self._open.is_set()

    @asynccontextmanager
    async def admit(self):
        await self._open.wait()
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    @asynccontextmanager
    async def paused(self):
        """Close the gate, wait for in-flight requests to drain, run the body, reopen."""
        self._open.clear()
        try:
            await self._idle.wait()
            yield
        finally:
            self._open.set()
