"""Random-init models of real instruct models' shapes (Qwen2.5's config.json values, tied embeddings): what the GPU
path is measured on where no weights can be downloaded. Their bytes, tensors and FLOPs are the real model's, their
outputs noise. The tiny test model's tokenizer goes with them: its ids fit every vocabulary, and the ids it lacks
decode to nothing."""

from __future__ import annotations

import tempfile
from pathlib import Path

QWEN2_5 = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960),
}


def shaped_model(name: str, dtype: str = "bfloat16", root: Path | None = None) -> Path:
    """The model directory for `name` (a QWEN2_5 key) in `dtype`, built once under `root` (the temp dir by default)
    through the same lock and rename as the built-in models."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    from lightning_ray.config import ModelConfig
    from lightning_ray.models import _cached, resolve_model_path

    if name not in QWEN2_5:
        raise ValueError(f"{name}: not a shape here (one of {', '.join(QWEN2_5)})")

    def build(path: Path) -> None:
        torch.manual_seed(0)
        config = Qwen2Config(vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
                             **QWEN2_5[name])
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
        model.save_pretrained(path, max_shard_size="100GB")  # one model.safetensors, what _cached looks for
        AutoTokenizer.from_pretrained(resolve_model_path(ModelConfig())).save_pretrained(path)

    return _cached((root or Path(tempfile.gettempdir())) / f"lightning-ray-{name}-{dtype}", build)
