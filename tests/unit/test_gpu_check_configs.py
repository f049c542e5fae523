"""The configs the GPU checks (scripts/gpu_check.sh's benchmarks) build for themselves pass the run's start checks,
and their baselines do the same work as ours. The configs are built only where CUDA is, so a check added on CPUs
would otherwise first fail them on a lent GPU node (as the weight-sync device check did to the update and weight-sync
steps): built here with CUDA said to be there."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from lightning_ray import weight_sync

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def benchmark(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("learner, transport", [({}, "cuda_ipc"), ({"lora": {}}, "adapter")])
def test_the_update_steps_learner_publishes_as_on_one_gpu(learner, transport):
    cfg = benchmark("update_speed").learner_config(8192, 1, 4, "auto", learner, cuda=True)
    assert cfg.learner.resources_per_worker["GPU"] == 0.5 and weight_sync.of_run(cfg) == transport


def test_the_update_steps_learner_of_several_ranks_publishes_as_split_does():
    cfg = benchmark("update_speed").learner_config(8192, 2, 4, "auto", {}, cuda=True)
    assert weight_sync.of_run(cfg) == "collective"


@pytest.mark.parametrize("transport", ["cuda_ipc", "collective", "object_store"])
def test_the_weight_sync_steps_replicas_take_the_transport_measured(transport):
    cfg = benchmark("weight_sync").serve_config(transport, 8000, 1, cuda=True)
    assert weight_sync.of_run(cfg) == transport and cfg.serve.resources["GPU"] > 0


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_the_weight_sync_steps_default_transports_fit_the_gpus_there(gpus):
    """Learner and replica of each default transport fit the GPUs (object_store on one GPU wanted two and hung)."""
    ws = benchmark("weight_sync")
    transports = ws.default_transports(True, gpus)
    assert "cuda_ipc" in transports and all(2 * ws.gpus_of(t, cuda=True) <= gpus for t in transports)
    assert ws.default_transports(False, 0) == ["object_store", "collective"]


def test_the_update_steps_bare_loop_takes_the_learners_gradient_with_none_of_its_code():
    """The bare side's textbook loss (its own padding, head and log-softmax) and the learner's scoring and policy
    loss give one gradient on the same micro-batches: the benchmark compares the same work, not our code twice."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_ray.algorithm.loss import policy_loss, token_weights
    from lightning_ray.learner.driver import micro_batches
    from lightning_ray.learner.scoring import collate, score

    update_speed = benchmark("update_speed")
    batch = update_speed.synthetic_batch(97, 8, 20, 9, seed=1)
    for i, t in enumerate(batch):  # ragged rows at two temperatures
        t.response_ids, t.logprobs, t.temperature = t.response_ids[: 2 + i], t.logprobs[: 2 + i], (0.7, 1.0)[i % 2]

    def gradient(loss_of_micro_batch) -> torch.Tensor:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=1, pad_token_id=0)).double()
        for mb in micro_batches(list(zip(batch, token_weights(batch, "token_mean", 96))), 64):
            loss_of_micro_batch(model, mb).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    def learners(model, mb):
        b = collate(mb, pad_id=0)
        logprobs = score(model, b).logprobs
        return policy_loss(logprobs, logprobs.detach(), b["advantages"], b["weights"], 0.2)[0]

    tokens = sum(len(t.response_ids) for t in batch)
    bare = gradient(lambda model, mb: update_speed.textbook_loss(model, [t for t, _ in mb], tokens))
    assert bare.norm() > 0 and torch.allclose(bare, gradient(learners), rtol=1e-9, atol=1e-12)
