"""The weight-sync transports (lightning_ray/weight_sync), through the real registry and the real Serve app on the
tiny model: buckets round-trip exactly; the collective transport (gloo here, NCCL on GPUs) brings one and two HF
replicas to the new version, a replica started after the publish catches up, and a learner that dies mid-transfer
makes the trainer's barrier raise with the reason, in seconds. The CUDA paths (CUDA IPC, NCCL, vLLM's own
weight-transfer API) are `gpu` tests: skipped without CUDA."""

from __future__ import annotations

import time

import httpx
import pytest
import ray
import torch

from helpers import small

from lightning_ray.config import LoraConfig
from lightning_ray.serving.app import deploy_policy
from lightning_ray.weight_sync import buckets as bk
from lightning_ray.weight_sync import resolve
from lightning_ray.weight_sync.registry import WeightRegistry

MODEL = "tiny-calc"
SMALL_BUCKETS = 64 << 10  # the tiny model (707 KB) in 8 buckets: a transfer has a middle to die in
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_buckets_round_trip_names_shapes_dtypes_and_bytes():
    g = torch.Generator().manual_seed(0)
    named = [("a.weight", torch.randn(3, 5, generator=g)), ("b.bf16", torch.randn(7, generator=g).bfloat16()),
             ("c.half", torch.randn(2, 3, 3, generator=g).half()), ("d.ids", torch.arange(5)),
             ("e.scalar", torch.tensor(2.5)), ("f.big", torch.randn(300, generator=g)),
             ("g.bf16", torch.randn(4, 4, generator=g).bfloat16()[:, 1])]  # not contiguous
    plan = bk.plan(named, bucket_bytes=256)
    assert all(len(set(b.dtype_names)) == 1 for b in plan)  # one dtype a bucket: every view is aligned
    assert any(b.names == ["f.big"] for b in plan)  # larger than a bucket: alone
    assert max(b.nbytes for b in plan if b.names != ["f.big"]) <= 256
    buffers = bk.allocate(plan, "cpu")
    bk.pack(dict(named), plan, buffers)
    out = dict(pair for buffer, bucket in zip(buffers, plan) for pair in bk.unpack(buffer, bucket))
    assert list(out) == [n for b in plan for n in b.names] and sorted(out) == sorted(n for n, _ in named)
    for name, t in named:
        assert out[name].dtype == t.dtype and out[name].shape == t.shape and torch.equal(out[name], t), name
    assert bk.matches(plan, named) and not bk.matches(plan, named[:-1])


@pytest.mark.parametrize("backend", ["ipc", "nccl"])
def test_what_the_transports_send_vllm_parses_where_this_vllm_reads_it(backend):
    """vLLM 0.32 reads the packed transfer's settings when its weight-transfer engine starts, vLLM 0.25 (the newest
    for torch 2.11) with each update: what cuda_ipc and collective send must parse into the installed vLLM's init
    and update infos, with packing on (no transfer is made: this runs on CPUs too)."""
    from lightning_ray.serving.engines.vllm import split_transfer_info, transfer_engine
    from lightning_ray.weight_sync import collective, cuda_ipc

    buckets = bk.plan([("a.weight", torch.zeros(3, 5)), ("b.weight", torch.zeros(7))], bucket_bytes=64)
    if backend == "ipc":
        init_info, updates = cuda_ipc.VLLM_INIT_INFO, [{**b.update_info(), "ipc_handles": {"GPU-x": ()}}
                                                       for b in buckets]
    else:
        init_info = collective.vllm_init_info("127.0.0.1", 29500, 1, buckets)
        updates = [collective.vllm_update_info(b) for b in buckets]
    init, per_update = split_transfer_info(backend, init_info)
    assert set(init) | set(per_update) == set(init_info)  # nothing dropped
    engine = transfer_engine(backend)
    started = engine.init_info_cls(**init)
    parsed = [engine.update_info_cls(**u, **per_update) for u in updates]
    assert [p.names for p in parsed] == [b.names for b in buckets]
    assert all(getattr(p, "packed", None) or getattr(started, "packed", None) for p in parsed)


def test_an_ipc_handle_crosses_to_vllms_engine_core(monkeypatch):
    """On a GPU vLLM's engine core is a process of its own: an update's CUDA IPC handles (torch's classes in a tuple,
    as reduce_tensor makes them) cross in vLLM's message to it only pickled, which the vLLM engine allows for the
    ipc transport (on CPUs the engine core runs in the replica's process: nothing crosses)."""
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from lightning_ray.serving.engines.vllm import WeightTransferUpdateRequest, allow_ipc_handles

    handle = (torch.Tensor, (2, 3), (3, 1), 0, torch.UntypedStorage, torch.bfloat16, 0, b"storage", 12, 0, False,
              b"refcount", 0, b"event", True)
    (bucket,) = bk.plan([("a.weight", torch.zeros(2, 3, dtype=torch.bfloat16))])
    request = WeightTransferUpdateRequest(update_info={**bucket.update_info(), "ipc_handles": {"GPU-x": handle}})
    message = (0, "call-1", "update_weights", (request,))  # as AsyncLLM's client sends a utility call
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "0")
    with pytest.raises(TypeError, match="not serializable"):
        MsgpackEncoder().encode(message)
    allow_ipc_handles()
    (_, _, _, (sent,)) = MsgpackDecoder().decode(MsgpackEncoder().encode(message))
    got = sent["update_info"]["ipc_handles"]["GPU-x"]  # msgpack's lists for tuples: rebuild_cuda_tensor takes both
    assert [tuple(x) if isinstance(x, list) else x for x in got] == list(handle)


def test_auto_picks_the_transport_from_the_placement():
    assert resolve("auto", {"CPU": 1}, {"CPU": 1}) == "object_store"
    assert resolve("auto", {"GPU": 1}, {"CPU": 1}) == "object_store"
    assert resolve("auto", {"GPU": 0.5}, {"GPU": 0.5}) == "cuda_ipc"
    assert resolve("auto", {"GPU": 1}, {"GPU": 1}) == "collective"
    assert resolve("collective", {}, {}) == "collective"


def test_lora_ships_its_adapter_where_the_replicas_have_gpus_and_merged_weights_on_cpus():
    lora = LoraConfig()  # sync: auto
    assert resolve("auto", {"CPU": 1}, {"CPU": 1}, lora) == "object_store"  # merged, by the run's transport
    assert resolve("auto", {"GPU": 1}, {"GPU": 1}, lora) == "adapter"
    assert resolve("auto", {"GPU": 0.5}, {"GPU": 0.5}, LoraConfig(sync="merged")) == "cuda_ipc"
    assert resolve("collective", {}, {}, LoraConfig(sync="adapter")) == "adapter"


def learner_actor(registry, model_path, kind: str = "collective", bucket_bytes: int = SMALL_BUCKETS,
                  die_after_bucket: int | None = None, device: str = "cpu", num_gpus: float = 0):
    """A stand-in for learner rank 0: the tiny model and a real publisher, in an actor of its own. Version v has
    the final norm scaled by 1 - 0.05 v. Defined in a function so Ray ships the class by value."""

    class Learner:
        def __init__(self):
            import os

            from transformers import AutoModelForCausalLM

            from lightning_ray.weight_sync import make_publisher

            torch.set_num_threads(1)
            self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
            self.norm = self.model.model.norm.weight.detach().clone()
            self.publisher = make_publisher({"kind": kind, "timeout_s": 20.0, "bucket_bytes": bucket_bytes},
                                            registry, torch.device(device))
            if die_after_bucket is not None:  # the process dies part way through a transfer
                self.publisher._sent = lambda i: os._exit(1) if i >= die_after_bucket else None

        def publish(self, version: int) -> None:
            with torch.no_grad():
                self.model.model.norm.weight.copy_(self.norm * (1 - 0.05 * version))
            ray.get(registry.publish.remote(version, self.publisher.publish(version, self.model)))

        def state_dict(self) -> dict:
            return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    return ray.remote(num_cpus=0, num_gpus=num_gpus)(Learner).remote()


def greedy_logprobs(url: str) -> list[float]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "What is 3 + 4?"}], "max_tokens": 4,
            "temperature": 0, "logprobs": True, "ignore_eos": True}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return [t["logprob"] for t in r.json()["choices"][0]["logprobs"]["content"]]


def test_collective_brings_every_replica_to_the_new_version(policy_app, tiny_model_path, serve_port, tmp_path):
    registry = WeightRegistry.remote()
    learner = learner_actor(registry, str(tiny_model_path))
    with policy_app(registry, serve={"sync_timeout_s": 30}) as app:
        url, before = app["url"], greedy_logprobs(app["url"])
        ray.get(learner.publish.remote(1))
        ray.get(registry.wait_synced.remote(1, 60))
        assert httpx.get(url + "/health").json()["policy_version"] == 1
        assert greedy_logprobs(url) != before

        # A second replica, started after the publish, fetches version 1 before Serve routes it anything.
        deploy_policy(small({"run_dir": str(tmp_path), "model": {"name": MODEL},
                             "serve": {"port": serve_port, "num_replicas": 2, "sync_timeout_s": 30}}),
                      str(tiny_model_path), app["store"], registry)
        served = ray.get(registry.served_versions.remote())
        assert len(served) >= 2 and all(v == 1 for v in served.values()), served

        ray.get(learner.publish.remote(2))
        ray.get(registry.wait_synced.remote(2, 60))  # every live replica acknowledged version 2
        answers = {tuple(greedy_logprobs(url)) for _ in range(6)}  # whichever replica answers
        assert len(answers) == 1, answers

        # Exactly the learner's weights: the same state through the object store serves the same logprobs.
        ray.get(registry.publish.remote(3, [ray.put(ray.get(learner.state_dict.remote()))]))
        ray.get(registry.wait_synced.remote(3, 60))
        assert {tuple(greedy_logprobs(url)) for _ in range(6)} == answers


def test_a_learner_that_dies_mid_transfer_fails_the_barrier_not_hangs_it(policy_app, tiny_model_path):
    registry = WeightRegistry.remote()
    dying = learner_actor(registry, str(tiny_model_path), die_after_bucket=2)
    with policy_app(registry, serve={"sync_timeout_s": 20}) as app:
        ray.get(dying.publish.remote(1))
        start = time.time()
        # the reason, from the replica: gloo's "Connection reset by peer" (measured: raised 0.05 s after the call)
        with pytest.raises(ray.exceptions.RayTaskError, match="policy version 1 could not be loaded.*(peer|closed)"):
            ray.get(registry.wait_synced.remote(1, 60))
        assert time.time() - start < 20  # told as it happens, not after the barrier's timeout
        health = httpx.get(app["url"] + "/health").json()
        assert health["policy_version"] == 0 and health["broken"] is None  # received aside: nothing served changed
        greedy_logprobs(app["url"])

        # A new learner (a restarted job) reaches the same replica: a new group, from its own address.
        learner = learner_actor(registry, str(tiny_model_path))
        ray.get(learner.publish.remote(2))
        ray.get(registry.wait_synced.remote(2, 60))
        assert httpx.get(app["url"] + "/health").json()["policy_version"] == 2


def test_the_learner_closes_the_groups_of_replicas_gone(ray_cluster):
    """A replica Serve replaced (its successor has a new id) leaves the registry; its group with the learner, NCCL's
    buffers on rank 0's GPU, is closed when the next group opens, not kept for the rest of the run."""
    from lightning_ray.weight_sync.collective import CollectivePublisher

    class Group:  # stands in for a process group: what close() did is all this test reads
        def __init__(self):
            self.closed = False

        def close(self):
            self.closed = True

    registry = WeightRegistry.remote()
    ray.get(registry.register_replica.remote("live"))
    publisher = CollectivePublisher(registry, torch.device("cpu"), timeout_s=5.0)
    try:
        live, gone = Group(), Group()
        publisher.groups = {"live": live, "gone": gone}
        publisher._close_groups_of_gone_replicas()
        assert (live.closed, gone.closed, list(publisher.groups)) == (False, True, ["live"])
    finally:
        publisher.close()
        ray.kill(registry)


# ---- CUDA: CUDA IPC and NCCL, with the HF engine and with vLLM's own weight-transfer API ------------------------
@pytest.mark.gpu
@needs_cuda
def test_buckets_round_trip_on_cuda():
    named = [("w", torch.randn(33, 7, device="cuda").bfloat16()), ("b", torch.randn(5, device="cuda"))]
    plan = bk.plan(named, 128)
    buffers = bk.allocate(plan, "cuda")
    bk.pack(dict(named), plan, buffers)
    out = dict(pair for buffer, bucket in zip(buffers, plan) for pair in bk.unpack(buffer, bucket))
    assert all(torch.equal(out[n], t) for n, t in named)


def _sync_and_compare(app, registry, learner, version: int) -> None:
    ray.get(learner.publish.remote(version))
    ray.get(registry.wait_synced.remote(version, 120))
    over_transport = greedy_logprobs(app["url"])
    ray.get(registry.publish.remote(version + 1, [ray.put(ray.get(learner.state_dict.remote()))]))
    ray.get(registry.wait_synced.remote(version + 1, 120))
    assert greedy_logprobs(app["url"]) == over_transport  # the same weights as the object store's copy


@pytest.mark.gpu
@needs_cuda
def test_cuda_ipc_into_the_hf_engine_on_the_learners_gpu(policy_app, tiny_model_path):
    registry = WeightRegistry.remote()
    learner = learner_actor(registry, str(tiny_model_path), "cuda_ipc", device="cuda", num_gpus=0.5)
    with policy_app(registry, serve={"resources": {"CPU": 1, "GPU": 0.5}}) as app:
        _sync_and_compare(app, registry, learner, 1)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs CUDA (two devices)")
def test_nccl_into_the_hf_engine_on_another_gpu(policy_app, tiny_model_path):
    registry = WeightRegistry.remote()
    learner = learner_actor(registry, str(tiny_model_path), "collective", device="cuda", num_gpus=1)
    with policy_app(registry, serve={"resources": {"CPU": 1, "GPU": 1}}) as app:
        _sync_and_compare(app, registry, learner, 1)


def _vllm_on_cuda() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _vllm_on_cuda(), reason="needs CUDA (and vLLM)")
def test_vllm_keeps_calls_going_across_an_update_over_cuda_ipc(policy_app, tiny_model_path):
    """serve.drain=keep on vLLM's weight-transfer path (pause keep, the update through its engine, the prefix cache
    reset, the version labels): on CPUs only its reload from disk keeps calls going. Each call is recorded with
    the tokens each version produced."""
    from helpers import stream_while_publishing

    from lightning_ray.serving.engines.vllm import LABELS_TOKENS

    if not LABELS_TOKENS:
        pytest.skip("serve.drain=keep needs vLLM's per-token weight labels (0.32; 0.25 refuses keep)")
    registry = WeightRegistry.remote()
    learner = learner_actor(registry, str(tiny_model_path), "cuda_ipc", device="cuda", num_gpus=0.5)

    def publish():
        ray.get(learner.publish.remote(1))
        ray.get(registry.wait_synced.remote(1, 120))

    with policy_app(registry, engine={"kind": "vllm", "gpu_memory_utilization": 0.3, "dtype": "float32"},
                    learner={"weight_sync": "cuda_ipc", "resources_per_worker": {"CPU": 1, "GPU": 0.5}},
                    serve={"drain": "keep", "resources": {"CPU": 1, "GPU": 0.5}}) as app:
        frames, spans, synced, ended = stream_while_publishing(app, publish, 4)
    assert "data: [DONE]" in frames and not any('"error"' in f for f in frames), frames[-3:]
    assert synced < ended and len(spans) == 4  # the update did not wait for the calls
    runs = [s.attributes["lightning_ray.policy_version_spans"] for s in spans]
    assert {v for r in runs for v, _, _ in r} == {0, 1} and all(r[-1][2] == 400 for r in runs), runs


@pytest.mark.gpu
@pytest.mark.skipif(not _vllm_on_cuda(), reason="needs CUDA (and vLLM)")
@pytest.mark.parametrize("kind,gpus", [("cuda_ipc", 0.5), ("collective", 1)])
def test_vllm_receives_through_its_weight_transfer_api(policy_app, tiny_model_path, kind, gpus):
    if gpus == 1 and torch.cuda.device_count() < 2:
        pytest.skip("needs CUDA (two devices)")
    registry = WeightRegistry.remote()
    learner = learner_actor(registry, str(tiny_model_path), kind, device="cuda", num_gpus=gpus)
    with policy_app(registry, engine={"kind": "vllm", "gpu_memory_utilization": 0.3, "dtype": "float32"},
                    learner={"weight_sync": kind, "resources_per_worker": {"CPU": 1, "GPU": gpus}},
                    serve={"resources": {"CPU": 1, "GPU": gpus}}) as app:
        _sync_and_compare(app, registry, learner, 1)
