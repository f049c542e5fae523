"""The learner's messages: an inbox per rank (the driver's commands) and one outbox (the ranks' replies), all held by
one actor beside the driver. A Ray queue each would start a process per rank and one more, at every run's start."""

from __future__ import annotations

import asyncio
import contextlib
import queue

import ray


@ray.remote(num_cpus=0)
class Mailboxes:
    def __init__(self, n: int):
        self.boxes = [asyncio.Queue() for _ in range(n)]

    async def put(self, box: int, message) -> None:
        self.boxes[box].put_nowait(message)

    async def get(self, box: int, timeout: float | None):
        """The box's next message; asyncio.TimeoutError after `timeout` seconds without one (None: waits)."""
        return await asyncio.wait_for(self.boxes[box].get(), timeout)

    async def empty(self, box: int) -> bool:
        return self.boxes[box].empty()


class Mailbox:
    """One box of a Mailboxes actor, used like a queue by the driver and the ranks (it travels to them pickled)."""

    def __init__(self, actor, box: int):
        self.actor, self.box = actor, box

    def put(self, message) -> None:
        ray.get(self.actor.put.remote(self.box, message))

    def get(self, timeout: float | None = None):
        """The next message; queue.Empty after `timeout` seconds without one. None waits, asking again every
        second: a wait left in the actor by a process that died would take the next message, meant for the process
        that replaced it (a restarted learner rank's attach), and a process restarts in more than a second."""
        if timeout is None:
            while True:
                with contextlib.suppress(queue.Empty):
                    return self.get(1.0)
        try:
            return ray.get(self.actor.get.remote(self.box, timeout))
        except asyncio.TimeoutError:  # the actor's, as Ray re-raises it here (a RayTaskError that is one too)
            raise queue.Empty from None

    def empty(self) -> bool:
        return ray.get(self.actor.empty.remote(self.box))
