"""The versioned weight registry: the learner publishes, every Serve replica pulls and acknowledges.

A Serve handle call reaches one replica, so weights are not pushed: replicas follow the registry, and a replica
started later (autoscaling, or Serve replacing a dead one) finds the latest version waiting. The trainer waits on
`wait_synced`, a barrier over all live replicas: a replica that died is forgotten, not waited for.

What a version's payload is depends on the transport (lightning_ray/weight_sync): an object-store reference, CUDA IPC
handles, or where to ask the learner for a broadcast. For the last, the registry also carries the requests: a
replica asks (`request_transfer`), the learner's sender thread takes them (`next_transfer`) and answers.
"""

from __future__ import annotations

import asyncio

import ray


@ray.remote(num_cpus=0)
class WeightRegistry:
    def __init__(self, version: int = 0):
        """`version`: the version of the weights the replicas start from (a resumed run's checkpoint's)."""
        self.version, self.payload = version, None
        self.acked: dict[str, int] = {}
        self.failed: dict[str, tuple[int, str]] = {}  # replica id -> the version it could not load, and why
        self.handles: dict[str, object] = {}  # replica id -> actor handle, to tell a slow replica from a dead one
        self._changed: asyncio.Condition | None = None
        self.publisher = None  # the learner's actor, when a transport needs it alive (collective)
        self.transfer_requests: asyncio.Queue = asyncio.Queue()
        self.transfers: dict[str, asyncio.Future] = {}  # request id -> the learner's answer
        self.taken: dict[str, float] = {}  # request id -> when the learner's sender took it
        self.sleep_epoch, self.asleep = 0, {}  # replica id -> the last sleep request it acknowledged
        self.wake_epoch = 0  # the last sleep request that ended with no new version to wake on (request_wake)

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

    async def publish(self, version: int, payload) -> None:
        """payload: what the transport's replicas need to get the weights, small (for the object store,
        [ObjectRef of the state dict], in a list so Ray passes the reference, not the tensors)."""
        self.version, self.payload = version, payload
        await self._notify()

    async def wait_newer(self, version: int, timeout_s: float) -> tuple[int, object]:
        await self._wait(lambda: self.version > version, timeout_s)
        return self.version, self.payload

    # ---- transfers a replica asks the learner for (weight_sync/collective.py) ------------------------------
    async def register_publisher(self, handle) -> None:
        self.publisher = handle

    async def request_transfer(self, request: dict, timeout_s: float) -> dict:
        """The learner's answer once its sender takes the request; raises if it does not answer within timeout_s of
        taking it, or at once if the learner is dead. Queued, a request waits its turn: the sender serves one replica
        at a time, each transfer bounded by its own timeout_s (weight_sync/collective.py)."""
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        self.transfers[request["id"]] = answer
        self.transfer_requests.put_nowait(request)
        try:
            while True:  # queued: no deadline while the learner lives (_check_publisher), one taken: timeout_s
                deadline = self.taken.get(request["id"], float("inf")) + timeout_s
                try:
                    return await asyncio.wait_for(asyncio.shield(answer), max(0.0, min(5.0, deadline - loop.time())))
                except asyncio.TimeoutError:
                    if loop.time() >= deadline:
                        raise TimeoutError(f"the learner did not answer the weight transfer request for version "
                                           f"{request['version']} in {timeout_s}s of its turn") from None
                    await self._check_publisher()
        finally:
            self.transfers.pop(request["id"], None)
            self.taken.pop(request["id"], None)

    async def next_transfer(self, timeout_s: float) -> dict | None:
        try:
            request = await asyncio.wait_for(self.transfer_requests.get(), timeout_s)
        except asyncio.TimeoutError:
            return None
        if request["id"] in self.transfers:  # still waited for
            self.taken[request["id"]] = asyncio.get_running_loop().time()
        return request

    async def answer_transfer(self, request_id: str, answer: dict) -> bool:
        """False if the replica stopped waiting (the learner then skips the transfer)."""
        future = self.transfers.get(request_id)
        if future is None or future.done():
            return False
        future.set_result(answer)
        return True

    async def _check_publisher(self) -> None:
        if self.publisher is None:
            return
        try:
            await asyncio.wait_for(self.publisher.__ray_ready__.remote(), 5.0)
        except asyncio.TimeoutError:
            pass  # alive but busy
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(f"the learner that publishes the weights died: {e}") from None

    async def ack(self, replica_id: str, version: int) -> None:
        self.acked[replica_id] = version
        self.failed.pop(replica_id, None)
        await self._notify()

    async def fail(self, replica_id: str, version: int, error: str) -> None:
        self.failed[replica_id] = (version, error)
        await self._notify()

    async def wait_synced(self, version: int, timeout_s: float) -> None:
        """Until every live replica serves `version`; raises at once if one could not load it, or once timeout_s
        passed without one more replica serving it (the collective transport serves them one after another)."""
        loop = asyncio.get_running_loop()
        deadline, done = loop.time() + timeout_s, 0
        synced = lambda: (self.acked and min(self.acked.values()) >= version) or self._failures(version)  # noqa: E731
        while not await self._wait(synced, 1.0):
            await self._forget_dead([r for r, v in self.acked.items() if v < version])
            if (now := sum(v >= version for v in self.acked.values())) > done:  # progress: another timeout_s
                deadline, done = loop.time() + timeout_s, now
            if loop.time() > deadline:
                behind = {r: v for r, v in self.acked.items() if v < version}
                raise TimeoutError(f"replicas still behind policy version {version}, none caught up in the last "
                                   f"{timeout_s}s: {behind}")
        if failures := self._failures(version):
            raise RuntimeError(f"policy version {version} could not be loaded: {failures}")

    def _failures(self, version: int) -> dict[str, str]:
        return {r: error for r, (v, error) in self.failed.items() if v == version and r in self.acked}

    async def _forget_dead(self, replica_ids: list[str]) -> None:
        for r in replica_ids:
            if r in self.handles:
                try:
                    await asyncio.wait_for(self.handles[r].__ray_ready__.remote(), 5.0)
                except (asyncio.TimeoutError, ray.exceptions.ActorUnavailableError):
                    pass  # busy (a long weight load) or unreachable for now (its node's network): it may come back
                except ray.exceptions.RayActorError:  # died: Serve replaces it with a new replica, which registers
                    del self.acked[r], self.handles[r]
                    self.failed.pop(r, None)

    # ---- colocated engines sleep while the learner trains (engine.sleep_while_training) ---------------------
    async def request_sleep(self) -> int:
        """Every replica frees the GPU memory its engine holds (serving paused); the next version it loads wakes it."""
        self.sleep_epoch += 1
        await self._notify()
        return self.sleep_epoch

    async def request_wake(self) -> None:
        """The sleeping replicas wake on the weights they hold: the learner's step published no new version to wake
        them (each of its optimizer steps skipped)."""
        self.wake_epoch = self.sleep_epoch
        await self._notify()

    async def wait_sleep_request(self, epoch: int, timeout_s: float, asleep: bool = False) -> tuple[int, int]:
        """(sleep epoch, wake epoch) once a sleep request after `epoch` came, or, for a replica `asleep` since
        `epoch`, a wake."""
        await self._wait(lambda: self.sleep_epoch > epoch or asleep and self.wake_epoch >= epoch, timeout_s)
        return self.sleep_epoch, self.wake_epoch

    async def ack_sleep(self, replica_id: str, epoch: int) -> None:
        self.asleep[replica_id] = epoch
        await self._notify()

    async def wait_asleep(self, epoch: int, timeout_s: float) -> None:
        """Until every live replica sleeps: then the learner may take the memory."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        awake = lambda: [r for r in self.acked if self.asleep.get(r, 0) < epoch]  # noqa: E731
        while not await self._wait(lambda: not awake(), 1.0):
            await self._forget_dead(awake())
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"replicas still awake after {timeout_s}s: {awake()}")

    async def served_versions(self) -> dict[str, int]:
        return dict(self.acked)

    async def replica_urls(self, app_name: str, host: str, node_ip: str) -> list[str]:
        """The replicas' own HTTP servers under Serve's direct ingress (serving/routing.py), for rollout workers that
        may not import Serve (rollout/routes.py)."""
        from lightning_ray.serving.routing import replica_urls

        return await replica_urls(app_name, host, node_ip)
