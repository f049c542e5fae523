from lightning_ray.serving.engines.base import Engine, Generation, SamplingParams, TokenDelta, generate


def make_engine(kind: str, model_path: str, max_model_len: int | None = None, **options) -> Engine:
    """The server enforces max_model_len on every request; vLLM also sizes its KV cache by it. dtype `auto` is
    resolved here, on the replica's own device: bfloat16 on a GPU, float32 on CPUs, where bf16 is unusably slow
    (vLLM's own `auto` would take the checkpoint's dtype)."""
    if options.get("dtype", "auto") == "auto":
        import torch

        options["dtype"] = "bfloat16" if torch.cuda.is_available() else "float32"
    if kind == "hf":
        from lightning_ray.serving.engines.hf import HFEngine

        return HFEngine(model_path, **options)
    if kind == "vllm":
        from lightning_ray.serving.engines.vllm import VLLMEngine

        return VLLMEngine(model_path, max_model_len=max_model_len, **options)
    raise ValueError(f"unknown engine {kind!r}: expected 'hf' or 'vllm'")


__all__ = ["Engine", "Generation", "SamplingParams", "TokenDelta", "generate", "make_engine"]
