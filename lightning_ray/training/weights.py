"""The versioned weight registry: the learner publishes, every Serve replica pulls and acknowledges.

A Serve handle call reaches one replica, so weights are not pushed: replicas follow the registry, and a replica
started later (autoscaling, or Serve replacing a dead one) finds the latest version waiting. The trainer waits on
`wait_synced`, a barrier over all live replicas: a replica that died is forgotten, not waited for.
"""

from __future__ import annotations

import asyncio

import ray


@ray.remote(num_cpus=0)
class WeightRegistry:
    def __init__(self):
        self.version, self.refs = 0, None
        self.acked: dict[str, int] = {}
        self.handles: dict[str, object] = {}  # replica id -> actor handle, to tell a slow replica from a dead one
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

    async def register_replica(self, replica_id: str, handle=None, version: int = 0) -> None:
        self.acked[replica_id] = version
        if handle is not None:
            self.handles[replica_id] = handle
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
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not await self._wait(lambda: self.acked and min(self.acked.values()) >= version, 1.0):
            await self._forget_dead([r for r, v in self.acked.items() if v < version])
            if asyncio.get_running_loop().time() > deadline:
                behind = {r: v for r, v in self.acked.items() if v < version}
                raise TimeoutError(f"replicas still behind policy version {version} after {timeout_s}s: {behind}")

    async def _forget_dead(self, replica_ids: list[str]) -> None:
        for r in replica_ids:
            if r in self.handles:
                try:
                    await asyncio.wait_for(self.handles[r].__ray_ready__.remote(), 5.0)
                except asyncio.TimeoutError:
                    pass  # alive but busy (a long weight load): keep waiting for it
                except ray.exceptions.RayActorError:
                    del self.acked[r], self.handles[r]

    async def served_versions(self) -> dict[str, int]:
        return dict(self.acked)
