"""The configs the GPU checks (scripts/gpu_check.sh's benchmarks) build for themselves pass the run's start checks.
They are built only where CUDA is, so a check added on CPUs would otherwise first fail them on a lent GPU node (as
the weight-sync device check did to the update and weight-sync steps): built here with CUDA said to be there."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

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
