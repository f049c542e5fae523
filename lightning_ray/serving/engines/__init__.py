from lightning_ray.serving.engines.base import Engine, Generation, SamplingParams


def make_engine(kind: str, model_path: str) -> Engine:
    if kind == "hf":
        from lightning_ray.serving.engines.hf import HFEngine

        return HFEngine(model_path)
    raise ValueError(f"unknown engine {kind!r}: expected 'hf'")


__all__ = ["Engine", "Generation", "SamplingParams", "make_engine"]
