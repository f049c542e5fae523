"""The collective transport (split placement: the learner and the engines on different GPUs or nodes).

The learner packs its weights into buckets on its device at each publish and publishes only their layout and
where to reach it. A replica that wants that version asks for it through the registry (`request_transfer`); a
sender thread on learner rank 0 takes the request, answers with the version it holds, and broadcasts the buckets
in a process group of its own with that replica: itself rank 0, the replica (or its tensor-parallel workers)
after. So replicas that start late, or come back, pull like the others, and the trainer's barrier stays the
registry's. Each replica keeps its group across versions
(an NCCL communicator takes ~1 s to build); a failure on either side drops it and the next request builds another.

Groups are made from the learner's own `TCPStore`, not `init_process_group`: the learner's DeepSpeed group stays
the default one. Wires: `torch` (a torch process group: NCCL on CUDA, gloo on CPU, so the whole path runs in CPU
tests) for the HF engine; `vllm_nccl` for vLLM on CUDA, which receives with its own weight-transfer API
(`WeightTransferConfig(backend="nccl")`, a `PyNcclCommunicator` per trainer and engine) — the learner then opens
the other end with vLLM's `StatelessProcessGroup`, and one bucket is one `update_weights` call, one broadcast.
vLLM's trainer-side engine (`NCCLTrainerWeightTransferEngine`) is not used: it drives the engine's RPCs itself
(push), and one group over the trainer and every engine would need every replica there at once, which a late
replica, a replaced one or a dead one breaks.

The sender serves one replica at a time. Each transfer, building its group included (NCCL's init waits for ever
for a peer that never joins), is bounded by serve.sync_timeout_s from when the sender takes the request: a
transfer that fails or stalls raises on both sides (the replica reports it to the registry, the barrier raises it)
and the group is dropped; nothing waits forever, and the next publish, which waits for the transfer, goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from unittest.mock import patch  # os.environ changed for a scope, restored after

import ray
import torch
import torch.distributed as dist

from lightning_ray.weight_sync import buckets as bk

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CollectiveOffer:
    version: int
    host: str  # the learner's node and its TCPStore, where groups meet
    port: int
    backend: str  # of the torch wire: "nccl" (a CUDA learner) or "gloo"
    buckets: list[bk.Bucket]


class CollectivePublisher:
    def __init__(self, registry, device: torch.device, timeout_s: float, bucket_bytes: int = bk.BUCKET_BYTES):
        self.registry, self.device = registry, torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # set_device and vLLM's NCCL need the index
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.timeout_s, self.bucket_bytes = timeout_s, bucket_bytes
        self.host = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=timeout_s))
        self.lock = threading.Lock()  # the buckets: written by publish, read by a transfer
        self.version, self.plan, self.buffers = 0, [], []
        self.groups: dict[str, _Group] = {}  # replica id -> its group with this learner
        try:
            me = ray.get_runtime_context().current_actor
        except RuntimeError:  # not in an actor (a publisher in a driver: tools)
            me = None
        if me is not None:  # lets a replica waiting on a dead learner fail fast
            ray.get(registry.register_publisher.remote(me))
        self._stop = threading.Event()
        self._sender = threading.Thread(target=self._serve_requests, daemon=True, name="weight-sender")
        self._sender.start()

    def publish(self, version: int, module: torch.nn.Module) -> CollectiveOffer:
        named = list(module.named_parameters())
        with self.lock:  # waits for a transfer in progress (a late replica's), at most timeout_s
            if not bk.matches(self.plan, named):
                self.plan = bk.plan(named, self.bucket_bytes)
                self.buffers = bk.allocate(self.plan, self.device)
            bk.pack(dict(named), self.plan, self.buffers)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the sender thread reads them next
            self.version = version
        return CollectiveOffer(version, self.host, self.store.port,
                               "nccl" if self.device.type == "cuda" else "gloo", self.plan)

    def close(self) -> None:
        self._stop.set()
        self._sender.join(timeout=5)
        for group in list(self.groups.values()):  # the sender, if still in a transfer, may change them
            group.close()

    # ---- the sender thread ---------------------------------------------------------------------------------
    def _serve_requests(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while not self._stop.is_set():
            try:
                request = ray.get(self.registry.next_transfer.remote(1.0))
            except Exception:  # the registry restarting, the job ending
                time.sleep(1.0)
                continue
            if request is not None:
                try:
                    self._serve(request)
                except Exception:
                    logger.exception("weight transfer to replica %s failed", request["replica"])

    def _serve(self, request: dict) -> None:
        replica, wire = request["replica"], request["wire"]
        with self.lock:
            group = self.groups.get(replica)
            reuse = group is not None and group.key == request["group"] and group.wire == wire
            answer = {"version": self.version, "group": group.key if reuse else request["id"], "new_group": not reuse}
            listener = None
            if not reuse and wire == "vllm_nccl":  # vLLM's rendezvous listens on a port of the trainer's
                listener = socket.create_server((self.host, 0))
                answer["port"] = listener.getsockname()[1]
            answered = ray.get(self.registry.answer_transfer.remote(request["id"], answer))
            if not answered or self.version != request["version"]:  # it gave up waiting; or asked for an old one
                if listener is not None:
                    listener.close()
                return
            deadline = time.monotonic() + self.timeout_s
            try:
                if not reuse:
                    if group is not None:
                        group.close()
                        group = None  # closed once: not again if its successor is not built
                    self.groups.pop(replica, None)
                    self._close_groups_of_gone_replicas()
                    make = (partial(_VllmNcclGroup, answer["group"], self.host, listener, self.device, self.timeout_s,
                                    1 + request.get("peers", 1))
                            if wire == "vllm_nccl" else
                            partial(_TorchGroup, answer["group"], self.store, 0, self.device, self.timeout_s, deadline))
                    group = self.groups[replica] = _build(make, deadline, f"replica {replica}")
                for i, buffer in enumerate(self.buffers):
                    group.broadcast(buffer, deadline)
                    self._sent(i)
            except BaseException:
                self.groups.pop(replica, None)
                if group is not None:
                    group.close()
                if listener is not None:  # a group that was not built: its rendezvous too
                    listener.close()
                raise

    def _close_groups_of_gone_replicas(self) -> None:
        """Serve replaces a dead replica by a new one (a new id): the old one's group, and the GPU buffers NCCL holds
        for it, would stay open for the rest of the run."""
        live = ray.get(self.registry.served_versions.remote())
        for gone in [r for r in self.groups if r not in live]:
            self.groups.pop(gone).close()

    def _sent(self, bucket: int) -> None:
        """After each bucket (a test makes the learner die here)."""


class CollectiveReceiver:
    """A replica's side: its group with the learner, kept across versions."""

    def __init__(self, registry, replica_id: str, timeout_s: float):
        self.registry, self.replica_id, self.timeout_s = registry, replica_id, timeout_s
        self.group: _Group | None = None
        self.learner: tuple[str, int] | None = None  # whose group it is (a restarted learner has a new store)

    async def receive(self, offer: CollectiveOffer, version: int, engine, paused) -> bool:
        engine.check_layout(bk.layout_of(offer.buckets))
        if (offer.host, offer.port) != self.learner:
            self._drop()
        if getattr(engine, "weight_transfer", None) == "nccl":
            return await self._receive_into_vllm(offer, version, engine, paused)
        answer = await self._request(version, "torch")
        if answer["version"] != version:
            return False  # superseded while we asked: the newer version is next
        device = engine.weights_device() if hasattr(engine, "weights_device") else torch.device("cpu")
        try:  # into buffers of our own while serving goes on; the served weights change only below
            buffers = await asyncio.to_thread(self._receive_buckets, offer, answer, device)
        except BaseException:
            self._drop()
            raise
        tensors = [pair for buffer, bucket in zip(buffers, offer.buckets) for pair in bk.unpack(buffer, bucket)]
        if hasattr(engine, "copy_weights"):
            async with paused():
                await engine.copy_weights(tensors, version)
        else:  # vLLM on CPU: through its reload from disk
            await engine.stage_weights(dict(tensors))
            async with paused():
                await engine.swap_weights(version)
        return True

    async def _request(self, version: int, wire: str, peers: int = 1) -> dict:
        """peers: the replica's ranks in the group (vLLM's tensor-parallel workers each receive every bucket)."""
        request = {"id": uuid.uuid4().hex, "replica": self.replica_id, "version": version, "wire": wire,
                   "group": self.group.key if self.group else None, "peers": peers}
        return await self.registry.request_transfer.remote(request, self.timeout_s)

    def _receive_buckets(self, offer: CollectiveOffer, answer: dict, device: torch.device) -> list[torch.Tensor]:
        deadline = time.monotonic() + self.timeout_s
        if answer["new_group"]:
            self._drop()

            def join() -> _TorchGroup:
                store = dist.TCPStore(offer.host, offer.port, is_master=False,
                                      timeout=timedelta(seconds=self.timeout_s))
                return _TorchGroup(answer["group"], store, 1, device, self.timeout_s, deadline)

            self.group = _build(join, deadline, f"the learner at {offer.host}:{offer.port}")
            self.learner = (offer.host, offer.port)
        if self.group is None:
            raise RuntimeError("the learner kept a weight-transfer group this replica no longer has")
        buffers = bk.allocate(offer.buckets, device)
        for buffer in buffers:
            self.group.broadcast(buffer, deadline)
        return buffers

    async def _receive_into_vllm(self, offer: CollectiveOffer, version: int, engine, paused) -> bool:
        """vLLM loads as it receives (layer by layer, into its weights), so all of it runs drained."""
        async with paused(), engine.drained():
            peers = engine.engine.vllm_config.parallel_config.world_size  # tensor-parallel workers
            answer = await self._request(version, "vllm_nccl", peers)
            if answer["version"] != version:
                return False
            try:
                if answer["new_group"]:
                    self.group, self.learner = None, (offer.host, offer.port)
                    await asyncio.wait_for(engine.init_weight_transfer(
                        vllm_init_info(offer.host, answer["port"], peers, offer.buckets)), self.timeout_s)
                    self.group = _RemoteGroup(answer["group"])
                updates = [vllm_update_info(b) for b in offer.buckets]
                await asyncio.wait_for(engine.apply_weight_update(updates, version), self.timeout_s)
            except BaseException as e:
                self._drop()
                if isinstance(e, asyncio.TimeoutError):  # vLLM's worker may still sit in the broadcast
                    engine.broken = f"receiving policy version {version} over NCCL timed out after {self.timeout_s}s"
                    raise RuntimeError(engine.broken) from None
                raise
        return True

    def _drop(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group, self.learner = None, None


def vllm_init_info(host: str, port: int, peers: int, buckets: list[bk.Bucket]) -> dict:
    """What a vLLM engine's NCCL weight-transfer engine joins the learner's group with: the learner rank 0, vLLM's
    `peers` (tensor-parallel) workers after it; one broadcast a bucket."""
    return {"master_address": host, "master_port": port, "rank_offset": 1, "world_size": 1 + peers, "packed": True,
            "packed_num_buffers": 1,
            # one bucket, one broadcast: vLLM cuts a chunk only past this size
            "packed_buffer_size_bytes": max(b.nbytes for b in buckets)}


def vllm_update_info(bucket: bk.Bucket) -> dict:
    return {k: v for k, v in bucket.update_info().items() if k != "tensor_sizes"}  # sizes: IPC's only


# ---- groups of two: rank 0 the learner, rank 1 a replica ------------------------------------------------------
class _Group:
    key: str
    wire: str

    def broadcast(self, tensor: torch.Tensor, deadline: float) -> None: ...

    def close(self) -> None: ...


class _TorchGroup(_Group):
    wire = "torch"

    def __init__(self, key: str, store, rank: int, device: torch.device, timeout_s: float, deadline: float):
        self.key = key
        prefixed = dist.PrefixStore(f"weights/{key}/", store)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timedelta(seconds=timeout_s + 60)  # ours first (below): torch's watchdog is a backstop
            # 2: on an error the watchdog aborts this communicator; its default (3) ends the whole process, and a
            # replica that died mid-transfer would then take the learner down with it
            with patch.dict(os.environ, TORCH_NCCL_ASYNC_ERROR_HANDLING="2"):
                self.pg = dist.ProcessGroupNCCL(prefixed, rank, 2, options)
            # NCCL builds its communicator in the first collective, blocking: here, which _build bounds, not in the
            # first bucket's broadcast
            self.broadcast(torch.zeros(1, device=device), deadline)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, 2, timedelta(seconds=timeout_s))

    def broadcast(self, tensor: torch.Tensor, deadline: float) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        work = self.pg.broadcast([tensor], options)
        _wait_until(work.is_completed, deadline, self.close)
        work.wait()  # raises what went wrong, if anything did
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()

    def close(self) -> None:
        try:
            self.pg.abort()
        except Exception:  # a backend without abort, or one already down
            pass


class _VllmNcclGroup(_Group):
    """The learner's end of a vLLM engine's NCCL weight-transfer group (the engine opens its own end)."""

    wire = "vllm_nccl"

    def __init__(self, key: str, host: str, listener: socket.socket, device: torch.device, timeout_s: float,
                 world_size: int):
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup
        try:
            from vllm.utils.nccl import unpinned_nccl_env
        except ImportError:  # vLLM 0.25 pins no NCCL settings in its processes: nothing to undo
            from contextlib import nullcontext as unpinned_nccl_env

        self.key = key
        port = listener.getsockname()[1]
        pg = StatelessProcessGroup.create(host, port, rank=0, world_size=world_size, store_timeout=int(timeout_s),
                                          listen_socket=listener)
        with unpinned_nccl_env():
            self.comm = PyNcclCommunicator(pg, device=device)

    def broadcast(self, tensor: torch.Tensor, deadline: float) -> None:
        stream = torch.cuda.current_stream(tensor.device)
        self.comm.broadcast(tensor, src=0, stream=stream)
        done = torch.cuda.Event()
        done.record(stream)
        _wait_until(done.query, deadline, self.close)

    def close(self) -> None:
        self.comm.destroy()


class _RemoteGroup(_Group):
    """A replica's record of a group whose communicator lives in vLLM's worker process."""

    wire = "vllm_nccl"

    def __init__(self, key: str):
        self.key = key

    def close(self) -> None:
        pass


def _build(make, deadline: float, peer: str) -> _Group:
    """`make()` a group in a thread of its own, waited for until the deadline: building one meets the peer in NCCL's
    init, which waits for ever for a peer that never joins (one that died, or cannot reach us). Past the deadline the
    group is abandoned to that thread, never used, and closed if it is built after all."""
    built = concurrent.futures.Future()

    def run() -> None:
        try:
            built.set_result(make())
        except BaseException as e:
            built.set_exception(e)

    threading.Thread(target=run, daemon=True, name="weight-group").start()
    concurrent.futures.wait([built], max(0.0, deadline - time.monotonic()))
    if not built.done():
        built.add_done_callback(lambda late: late.exception() is None and late.result().close())
        raise TimeoutError(f"weight sync: no transfer group with {peer} by the deadline (serve.sync_timeout_s): it "
                           f"did not join (died, or cannot reach this node)")
    return built.result()


def _wait_until(done, deadline: float, abort) -> None:
    """Poll `done()` until the deadline, then abort the group and raise: a collective that lost its peer would
    otherwise wait forever (NCCL) or as long as the process group's timeout (gloo)."""
    pause = 1e-4
    while not done():
        if time.monotonic() > deadline:
            abort()
            raise TimeoutError("a weight-transfer broadcast did not finish in time: the other side stopped or died")
        time.sleep(pause)
        pause = min(pause * 2, 0.01)

