"""Pause and resume around a weight update. While paused, new requests wait (they are held, not refused); what
happens to the requests already generating is `serve.drain`:

- wait: they finish first, unless one outlives the drain deadline: it is then ended (`DrainTimeout`), so a stuck
  generation cannot hold the policy back forever;
- abort: they are ended at once (503; the OpenAI client and LangChain retry it, under the new weights);
- keep: they go on; the engine swaps the weights in between two of their decoding steps (a partial rollout: the
  tokens after the swap are the new version's, and each span says which tokens each version produced).

A pause that must stop every generation (an engine put to sleep, vLLM swapping an adapter) drains as `wait` does
under `keep`."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Literal

Drain = Literal["wait", "abort", "keep"]


class DrainTimeout(Exception):
    """A generation ended by the gate for a weight update (the drain deadline, or serve.drain=abort)."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


class Gate:
    def __init__(self, drain_timeout_s: float = 60.0, drain: Drain = "wait"):
        self.drain_timeout_s, self.drain = drain_timeout_s, drain
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._admitted: set[asyncio.Task] = set()
        self._ended: set[asyncio.Task] = set()  # cancelled by the drain deadline, or aborted
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
            if self.drain == "abort":
                raise DrainTimeout("ended by a policy weight update (serve.drain=abort); retry the request",
                                   "weight_update") from None
            raise DrainTimeout(f"ended after {self.drain_timeout_s:g} s: a policy weight update was waiting for "
                               f"this generation to finish; retry the request", "drain_timeout") from None
        finally:
            self._admitted.discard(task)
            self._ended.discard(task)
            if not self._admitted:
                self._idle.set()

    def for_weights(self, keeps_generations: bool = True):
        """The pause a weight update runs under: `paused()`, or under `keep` one that lets generations go on where
        the engine can load these weights under them (keeps_generations)."""
        return self.paused(stop_generations=self.drain != "keep" or not keeps_generations)

    @asynccontextmanager
    async def paused(self, stop_generations: bool = True):
        """Close the gate; if stop_generations, wait for in-flight requests to drain (ending those past the deadline,
        or at once under `abort`); run the body; reopen."""
        self._open.clear()
        self._pauses += 1
        try:
            if stop_generations:
                try:
                    await asyncio.wait_for(self._idle.wait(),
                                           0 if self.drain == "abort" else self.drain_timeout_s)
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
