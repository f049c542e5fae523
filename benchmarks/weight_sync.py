"""Weight sync, per transport: from the learner's publish to every replica serving the new version (the registry's
barrier), beside a pinned device-to-host copy of the same weights (the issue's baseline; on CPU a plain copy).
One JSON line per model and transport, with the ratio of the two (`vs_host_copy`: publish → served over the copy).

    .venv/bin/python benchmarks/weight_sync.py             # CPU: the tiny model; object_store, collective (gloo)
    python benchmarks/weight_sync.py --models 0.5b 1.5b    # CUDA: Qwen2.5-shaped random-init models in bf16;
                                                           # cuda_ipc colocated; object_store and collective
                                                           # with 2+ GPUs (a GPU each for learner and replica)

The learner is a stand-in actor holding the model and the run's publisher (weight_sync.make_publisher), as learner
rank 0 does; replicas are the real policy app (HF engine). Version 1 is a warm-up (the first group, the first IPC
mapping, the engine's first load); the figure is the median of the next `--versions`, and the host copy's the
median of as many copies after one of warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import ray
import torch

def model_dir(name: str, dtype: torch.dtype) -> Path:
    from lightning_ray.config import ModelConfig
    from lightning_ray.models import resolve_model_path
    from lightning_ray.models.shaped import shaped_model

    if name == "tiny":
        return resolve_model_path(ModelConfig())
    return shaped_model(f"qwen2.5-{name}", str(dtype).removeprefix("torch."))


def learner_actor(registry, path: str, kind: str, device: str, dtype: torch.dtype, num_gpus: float):
    class Learner:
        def __init__(self):
            from transformers import AutoModelForCausalLM

            from lightning_ray.weight_sync import make_publisher

            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
            self.publisher = make_publisher({"kind": kind, "timeout_s": 300.0}, registry, torch.device(device))

        def nbytes(self) -> int:
            named = self.model.state_dict().items() if kind == "object_store" else self.model.named_parameters()
            return sum(t.numel() * t.element_size() for _, t in named)

        def publish(self, version: int) -> float:
            with torch.no_grad():  # a new version: every weight moves a little (also keeps them in place)
                for p in self.model.parameters():
                    p.mul_(1 - 1e-3)
            start = time.perf_counter()
            ray.get(registry.publish.remote(version, self.publisher.publish(version, self.model)))
            return time.perf_counter() - start

        def host_copy_s(self, repeats: int) -> float:
            """The baseline: every parameter into (pinned, on CUDA) host memory; as the sync's figure, the median of
            `repeats` after a warm-up (was the min of 3 against the sync's median)."""
            named = list(self.model.named_parameters())
            pinned = torch.cuda.is_available() and device.startswith("cuda")
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for _, t in named]
            times = []
            for _ in range(repeats + 1):
                start = time.perf_counter()
                for (_, t), h in zip(named, host):
                    h.copy_(t.detach(), non_blocking=pinned)
                if pinned:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            return statistics.median(times[1:])

    return ray.remote(num_cpus=0, num_gpus=num_gpus)(Learner).remote()


def gpus_of(kind: str, cuda: bool) -> float:
    return (0.5 if kind == "cuda_ipc" else 1) if cuda else 0  # cuda_ipc: learner and replica share a GPU


def default_transports(cuda: bool, gpus: int) -> list[str]:
    """Those whose learner and replica fit the GPUs there: object_store and collective take a whole GPU each for
    the learner and the replica, so on one GPU the replica could never be placed and the run would wait forever."""
    if not cuda:
        return ["object_store", "collective"]
    return ["cuda_ipc"] + (["object_store", "collective"] if gpus > 1 else [])


def serve_config(kind: str, port: int, replicas: int, cuda: bool):
    """The run's config of the replicas, and of the learner's device for the transport's start checks."""
    from lightning_ray.config import validate

    device = {"CPU": 1, **({"GPU": gpus_of(kind, cuda)} if cuda else {})}
    return validate({"run_dir": tempfile.mkdtemp(), "model": {"name": "bench"},
                     "engine": {"kind": "hf", "dtype": "bfloat16" if cuda else "float32"},
                     "learner": {"weight_sync": kind, "resources_per_worker": device},
                     "serve": {"port": port, "num_replicas": replicas, "sync_timeout_s": 300, "resources": device}})


def run(model: str, path: Path, kind: str, cuda: bool, replicas: int, versions: int, port: int) -> dict:
    from lightning_ray.serving.app import APP_NAME, deploy_policy
    from lightning_ray.serving.deploy import delete_apps
    from lightning_ray.store.client import StoreClient
    from lightning_ray.weight_sync.registry import WeightRegistry

    dtype = torch.bfloat16 if cuda else torch.float32
    gpus = gpus_of(kind, cuda)
    if cuda and gpus * (1 + replicas) > ray.cluster_resources().get("GPU", 0):  # else a replica waits forever
        raise SystemExit(f"{kind} with {replicas} replica(s) needs {gpus * (1 + replicas):g} GPUs (learner and "
                         f"replicas {gpus:g} each), {ray.cluster_resources().get('GPU', 0):g} here")
    registry = WeightRegistry.remote()
    store = StoreClient.start(Path(tempfile.mkdtemp(prefix="weight-sync-store-")))
    learner = learner_actor(registry, str(path), kind, "cuda" if cuda else "cpu", dtype, gpus)
    cfg = serve_config(kind, port, replicas, cuda)
    deploy_policy(cfg, str(path), store, registry)
    try:
        seconds, publish_seconds = [], []
        for version in range(1, versions + 2):
            start = time.perf_counter()
            publish_seconds.append(ray.get(learner.publish.remote(version)))
            ray.get(registry.wait_synced.remote(version, 600))
            seconds.append(time.perf_counter() - start)
        served = ray.get(registry.served_versions.remote())
        assert len(served) == replicas and set(served.values()) == {versions + 1}, served
        served_s, copy_s = statistics.median(seconds[1:]), ray.get(learner.host_copy_s.remote(versions))
        return {"model": model, "transport": kind, "device": "cuda" if cuda else "cpu", "replicas": replicas,
                "bytes": ray.get(learner.nbytes.remote()),
                "publish_to_served_s": round(served_s, 4), "first_s": round(seconds[0], 4),
                "learner_publish_s": round(statistics.median(publish_seconds[1:]), 4),
                "host_copy_baseline_s": round(copy_s, 4),
                "vs_host_copy": round(served_s / copy_s, 2)}  # ours over the baseline, medians of `versions` each
    finally:
        delete_apps([APP_NAME])
        ray.kill(learner)


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["0.5b", "1.5b"] if cuda else ["tiny"],
                        choices=["tiny", "0.5b", "1.5b"])
    parser.add_argument("--transports", nargs="+", default=None)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--versions", type=int, default=3)
    parser.add_argument("--port", type=int, default=8123)
    args = parser.parse_args()
    transports = args.transports or default_transports(cuda, torch.cuda.device_count() if cuda else 0)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    for model in args.models:
        path = model_dir(model, torch.bfloat16 if cuda else torch.float32)
        for kind in transports:
            print(json.dumps(run(model, path, kind, cuda, args.replicas, args.versions, args.port)), flush=True)


if __name__ == "__main__":
    main()
