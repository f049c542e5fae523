from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_ray.serving.engines.base import Engine, Generation, SamplingParams, TokenDelta, generate

if TYPE_CHECKING:
    from lightning_ray.config import EngineConfig


def make_engine(kind: str, model_path: str, max_model_len: int | None = None, **options) -> Engine:
    """The server enforces max_model_len on every request; vLLM also sizes its KV cache by it. dtype `auto` is
    resolved here, on the replica's own device: bfloat16 on a GPU, float32 on CPUs (vLLM's own `auto` would take the
    checkpoint's dtype). Not bf16 on CPUs even with AMX, where it serves 2.3x faster and make train learned as well:
    it serves the learner's small updates rounded to bf16's grid, unbiased only for weights off that grid (SmolLM2's
    79%; a bf16 checkpoint's none): benchmarks/results/bf16_cpu.json."""
    if options.get("dtype", "auto") == "auto":
        import torch

        options["dtype"] = "bfloat16" if torch.cuda.is_available() else "float32"
    if kind == "hf":
        from lightning_ray.serving.engines.hf import HFEngine

        check_positions(model_path, max_model_len)
        return HFEngine(model_path, **options)
    if kind == "vllm":
        from lightning_ray.serving.engines.vllm import VLLMEngine

        return VLLMEngine(model_path, max_model_len=max_model_len, **options)
    raise ValueError(f"unknown engine {kind!r}: expected 'hf' or 'vllm'")


def check_positions(model_path: str, max_model_len: int | None) -> None:
    """A context past the model's positions would be served from positions it never learned, silently: refused, as
    vLLM refuses it (a model with RoPE scaling is left to its own rules)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    scaling = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    positions = None if scaling.get("factor") else getattr(config, "max_position_embeddings", None)
    if max_model_len and positions and max_model_len > positions:
        raise ValueError(f"engine.max_model_len={max_model_len} is more than the model's {positions} positions "
                         f"(max_position_embeddings in {model_path}/config.json): lower engine.max_model_len")


def engine_options(e: EngineConfig) -> dict:
    """What make_engine takes: the settings both engines read, vLLM's own, then engine.options as they are."""
    vllm = {"tensor_parallel_size": e.tensor_parallel_size, "enable_prefix_caching": e.prefix_caching,
            "sleep_mode": e.sleep_while_training}
    both = {"dtype": e.dtype, "gpu_memory_utilization": e.gpu_memory_utilization}
    if e.max_num_seqs is not None:
        both["max_num_seqs"] = e.max_num_seqs
    return {**both, **(vllm if e.kind == "vllm" else {}), **e.options}


__all__ = ["Engine", "Generation", "SamplingParams", "TokenDelta", "engine_options", "generate", "make_engine"]
