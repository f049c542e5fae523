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
        self.failed: dict[str, tuple[int, str]] = {}  # replica id -> the version it could not load, and why
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

    async def register_replica(self, replica_id: str, handle=None) -> None:
        """A starting replica, before it looks for the latest version: every publish from now on waits for it."""
        self.acked[replica_id] = 0
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
        self.failed.pop(replica_id, None)
        await self._notify()

    async def fail(self, replica_id: str, version: int, error: str) -> None:
        self.failed[replica_id] = (version, error)
        await self._notify()

    async def wait_synced(self, version: int, timeout_s: float) -> None:
        """Until every live replica serves `version`; raises at once if one could not load it."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        synced = lambda: (self.acked and min(self.acked.values()) >= version) or self._failures(version)  # noqa: E731
        while not await self._wait(synced, 1.0):
            await self._forget_dead([r for r, v in self.acked.items() if v < version])
            if asyncio.get_running_loop().time() > deadline:
                behind = {r: v for r, v in self.acked.items() if v < version}
                raise TimeoutError(f"replicas still behind policy version {version} after {timeout_s}s: {behind}")
        if failures := self._failures(version):
            raise RuntimeError(f"policy version {version} could not be loaded: {failures}")

    def _failures(self, version: int) -> dict[str, str]:
        return {r: error for r, (v, error) in self.failed.items() if v == version and r in self.acked}

    async def _forget_dead(self, replica_ids: list[str]) -> None:
        for r in replica_ids:
            if r in self.handles:
                try:
                    await asyncio.wait_for(self.handles[r].__ray_ready__.remote(), 5.0)
                except asyncio.TimeoutError:
                    pass  # alive but busy (a long weight load): keep waiting for it
                except ray.exceptions.RayActorError:
                    del self.acked[r], self.handles[r]
                    self.failed.pop(r, None)

    async def served_versions(self) -> dict[str, int]:
        return dict(self.acked)
