from lightning_ray.serving.engines.base import Engine, Generation, SamplingParams, TokenDelta, generate


def make_engine(kind: str, model_path: str, **options) -> Engine:
    if kind == "hf":
        from lightning_ray.serving.engines.hf import HFEngine

        return HFEngine(model_path, **options)
    if kind == "vllm":
        from lightning_ray.serving.engines.vllm import VLLMEngine

        return VLLMEngine(model_path, **options)
    raise ValueError(f"unknown engine {kind!r}: expected 'hf' or 'vllm'")


__all__ = ["Engine", "Generation", "SamplingParams", "TokenDelta", "generate", "make_engine"]
