"""Weight synchronisation: how a new policy version gets from the learner into every serving engine.

One file per transport, behind one small interface. The learner side, `publish(version, module) -> payload`, runs on
rank 0 with the policy's parameters whole (inside ZeRO-3's gather: it copies what it needs); the payload is small
and picklable and goes to the weight registry (weight_sync/registry.py), the one control plane: replicas pull it,
acknowledge or report a failure, and the trainer's barrier waits on them, whatever the transport. The replica side,
`Receiver.receive(payload, version, paused)`, gets the tensors into its engine and returns False if the version
was superseded before it could be fetched, or its publisher died (the newer one follows).

- object_store: a host copy through Ray's object store (the CPU default).
- cuda_ipc: colocated on one GPU; the replica copies straight from the learner's GPU memory.
- collective: separate GPUs or nodes; a broadcast from learner rank 0 to the replica that asks (NCCL; gloo on CPU).
- adapter (learner.lora.sync): a LoRA adapter alone, through the object store; the engines apply it on their base.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from lightning_ray.placement import share_a_gpu

if TYPE_CHECKING:  # torch is imported where a transport runs: the weight registry's process needs none of it (~2 s)
    import torch

    from lightning_ray.config import LoraConfig, TrainConfig

TRANSPORTS = ("object_store", "cuda_ipc", "collective")


class Publisher(Protocol):
    def publish(self, version: int, module: torch.nn.Module) -> object: ...

    def close(self) -> None: ...


def resolve(kind: str, learner_resources: dict, replica_resources: dict, lora: LoraConfig | None = None,
            adapters: bool = False) -> str:
    """`auto`: the object store unless the learner and the replicas both have GPUs; then CUDA IPC where they share
    one (Ray lets two actors share a GPU only if each asks for a fraction of it), else a collective broadcast.
    With LoRA, `adapter` where learner.lora.sync says so (auto: where the replicas have GPUs, or adapters are served
    as such: algorithm.adapters, model.adapter); merged weights take the run's transport."""
    learner_gpu, replica_gpu = learner_resources.get("GPU", 0), replica_resources.get("GPU", 0)
    if lora and (lora.sync == "adapter" or lora.sync == "auto" and (replica_gpu or adapters)):
        return "adapter"
    if kind == "collective" and bool(learner_gpu) != bool(replica_gpu):  # each side would wait out the timeout
        raise ValueError("learner.weight_sync=collective broadcasts over NCCL between GPUs or gloo between CPUs: the "
                         "learner (learner.resources_per_worker) and the replicas (serve.resources) both on GPUs, or "
                         "neither; auto picks the transport that fits")
    if kind == "cuda_ipc" and not (learner_gpu and replica_gpu):
        raise ValueError("learner.weight_sync=cuda_ipc copies from the learner's GPU memory: the learner "
                         "(learner.resources_per_worker) and the replicas (serve.resources) on one GPU "
                         "(placement=colocated); auto picks the transport that fits")
    if kind != "auto":
        return kind
    if not (learner_gpu and replica_gpu):
        return "object_store"
    return "cuda_ipc" if share_a_gpu(learner_resources, replica_resources) else "collective"


def of_run(cfg: TrainConfig) -> str:
    """A run's transport, resolved from its config: what the learner publishes by and the replicas expect."""
    t = cfg.learner
    return resolve(t.weight_sync, t.resources_per_worker, cfg.serve.resources, t.lora,
                   bool(cfg.algorithm.adapters or cfg.model.adapter))


def make_publisher(options: dict, registry, device: torch.device) -> Publisher:
    """options: {"kind": a resolved transport, "timeout_s": serve.sync_timeout_s, "bucket_bytes": optional}."""
    import torch

    from lightning_ray.weight_sync import object_store
    from lightning_ray.weight_sync.buckets import BUCKET_BYTES

    kind, bucket_bytes = options["kind"], options.get("bucket_bytes", BUCKET_BYTES)
    if kind == "object_store":
        return object_store.ObjectStorePublisher()
    if kind == "adapter":
        from lightning_ray.weight_sync.adapter import AdapterPublisher

        return AdapterPublisher()
    if kind == "cuda_ipc":
        from lightning_ray.weight_sync.cuda_ipc import CudaIpcPublisher

        if torch.device(device).type != "cuda":
            raise ValueError("learner.weight_sync=cuda_ipc needs a CUDA learner")
        return CudaIpcPublisher(torch.device(device), bucket_bytes)
    if kind == "collective":
        from lightning_ray.weight_sync.collective import CollectivePublisher

        return CollectivePublisher(registry, device, options["timeout_s"], bucket_bytes)
    raise ValueError(f"unknown weight_sync {kind!r}: expected one of {TRANSPORTS}")


def engine_weight_transfer(kind: str, engine: str) -> str | None:
    """The vLLM weight-transfer backend a replica's engine is built with (vLLM fixes it at start), on CUDA only."""
    import torch

    if engine != "vllm" or not torch.cuda.is_available():
        return None
    return {"cuda_ipc": "ipc", "collective": "nccl"}.get(kind)


class Receiver:
    """A replica's side of every transport; the payload says which one sent it."""

    def __init__(self, registry, replica_id: str, engine, timeout_s: float):
        from lightning_ray.weight_sync.collective import CollectiveReceiver

        self.engine = engine
        self.collective = CollectiveReceiver(registry, replica_id, timeout_s)

    async def receive(self, payload, version: int, paused) -> bool:
        """paused: an async context manager factory under which no request generates (the server's gate)."""
        from lightning_ray.weight_sync.collective import CollectiveOffer
        from lightning_ray.weight_sync.cuda_ipc import IpcOffer

        if isinstance(payload, CollectiveOffer):
            return await self.collective.receive(payload, version, self.engine, paused)
        if isinstance(payload, IpcOffer):
            from lightning_ray.weight_sync import cuda_ipc

            return await cuda_ipc.receive(payload, version, self.engine, paused)
        from lightning_ray.weight_sync import object_store

        return await object_store.receive(payload, version, self.engine, paused)
