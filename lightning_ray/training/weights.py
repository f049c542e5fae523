"""The versioned weight registry: the learner publishes, every Serve replica pulls and acknowledges.

A Serve handle call reaches one replica, so weights are not pushed: replicas follow the registry, and a replica
started later finds the latest version waiting. The trainer waits on `wait_synced`, a barrier over all replicas.
"""

from __future__ import annotations

import asyncio

import ray


@ray.remote(num_cpus=0)
class WeightRegistry:
    def __init__(self):
        self.version, self.refs = 0, None
        self.acked: dict[str, int] = {}
        self._changed: asyncio.Condition | None = None

    @property
    def changed(self) -> asyncio.Condition:
        self._changed = self._changed or asyncio.Condition()  # made on the actor's event loop
        return self._changed

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def _wait(self, predicate, timeout_s: float) -> bool:
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(predicate), timeout_s)
                return True
            except asyncio.TimeoutError:
                return False

    async def register_replica(self, replica_id: str) -> None:
        self.acked[replica_id] = 0
        await self._notify()

    async def publish(self, version: int, refs: list) -> None:
        """refs: [ObjectRef of the state dict], in a list so Ray passes the reference, not the tensors."""
        self.version, self.refs = version, refs
        await self._notify()

    async def wait_newer(self, version: int, timeout_s: float) -> tuple[int, list | None]:
        await self._wait(lambda: self.version > version, timeout_s)
        return self.version, self.refs

    async def ack(self, replica_id: str, version: int) -> None:
        self.acked[replica_id] = version
        await self._notify()

    async def wait_synced(self, version: int, timeout_s: float) -> None:
        if not await self._wait(lambda: self.acked and min(self.acked.values()) >= version, timeout_s):
            behind = {r: v for r, v in self.acked.items() if v < version}
            raise TimeoutError(f"replicas still behind policy version {version} after {timeout_s}s: {behind}")

    async def served_versions(self) -> dict[str, int]:
        return dict(self.acked)
