"""SpanWriter: a policy replica's span writes, grouped (group commit).

Each call's spans must be in the store before its answer leaves (a rollout that ends has all its calls), but one
store call per model call makes the store's actor call and SQLite transaction the fixed cost of every request. So
while one group is on its way to the store, the spans of calls that end meanwhile wait, and go together in the next:
a lone call goes at once, and under load one store call carries many (about calls/s × a store round trip).
"""

from __future__ import annotations

import asyncio

from lightning_ray.types import Span

MAX_GROUP_SPANS = 1_000  # well under the store's max_batch_spans


class SpanWriter:
    def __init__(self, store, origin: str):
        self.store, self.origin = store, origin
        self.waiting: list[tuple[list[Span], asyncio.Future]] = []
        self.writing: asyncio.Task | None = None  # the task writing the groups, while there are any

    async def write(self, spans: list[Span]) -> None:
        """Store these spans (as the store's add_spans_async, strict): returns once they are, raises if they are
        not. A caller cancelled meanwhile leaves its spans to be written all the same."""
        done = asyncio.get_running_loop().create_future()
        self.waiting.append((spans, done))
        if self.writing is None:
            self.writing = asyncio.get_running_loop().create_task(self._write_groups())
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            done.add_done_callback(lambda f: f.cancelled() or f.exception())  # its outcome read: nobody else will
            raise

    async def _write_groups(self) -> None:
        try:
            while self.waiting:
                group, size = [], 0
                while self.waiting and (not group or size + len(self.waiting[0][0]) <= MAX_GROUP_SPANS):
                    group.append(self.waiting.pop(0))
                    size += len(group[-1][0])
                await self._write(group)
        finally:
            self.writing = None

    async def _write(self, group: list[tuple[list[Span], asyncio.Future]]) -> None:
        try:
            result = await self.store.add_spans_async([s for spans, _ in group for s in spans], strict=False,
                                                      origin=self.origin)
            if not result["rejected"]:
                for _, done in group:
                    done.set_result(None)
                return
        except Exception:
            pass
        # Some span was refused, or the group failed: each call's spans again, alone and at once, for its own answer
        # (the store ignores a span it already has, so those the group stored are not stored twice; a refused one is
        # counted twice among the store's errors).
        await asyncio.gather(*(self._write_alone(spans, done) for spans, done in group))

    async def _write_alone(self, spans: list[Span], done: asyncio.Future) -> None:
        try:
            await self.store.add_spans_async(spans, origin=self.origin)
            done.set_result(None)
        except Exception as e:
            done.set_exception(e)
