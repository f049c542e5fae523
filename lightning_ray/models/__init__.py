"""Model and tokenizer loading; the tiny locally built test model."""

from __future__ import annotations

from pathlib import Path

from lightning_ray.config import ModelConfig


def resolve_model_path(cfg: ModelConfig) -> Path:
    """The HF directory to serve and train: cfg.path, or the tiny model, built once into the cache."""
    if cfg.path:
        path = Path(cfg.path).expanduser()
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model.path={cfg.path}: no config.json there (expected an HF model directory)")
        return path
    path = Path(cfg.cache_dir).expanduser() / "tiny-calc-v2"
    if not (path / "model.safetensors").exists():
        import os
        import shutil

        from lightning_ray.models.tiny import build_tiny_model

        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")  # one per process: builds may run side by side
        build_tiny_model(tmp)
        try:
            tmp.rename(path)  # atomic: a crash mid-build never leaves a half-written model behind
        except OSError:  # another process finished first; the build is deterministic, keep theirs
            shutil.rmtree(tmp)
    return path
