"""LoRA's weight sync (learner.lora): the adapter alone goes to the engines — a few MB where the merged weights are
the whole model — and they apply it on the base they loaded (peft in the HF engine, vLLM's LoRA support). It travels
as peft saves it, so both engines read their usual format; through the object store, whatever the transport: it is
small enough on any hardware. With an adapter per agent (algorithm.adapters) every one of them travels, each under
its name (peft's own adapter is `default`), and the engines serve each call with the one it names."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import ray

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
DEFAULT = "default"  # peft's name for a model's only adapter: learner.lora without algorithm.adapters


@dataclass(frozen=True)
class Adapter:
    """peft's two files of a LoRA adapter, in memory, and the adapter's name."""

    files: dict[str, bytes]
    name: str = DEFAULT

    @classmethod
    def of(cls, model, name: str = DEFAULT) -> Adapter:
        """One of a peft model's adapters (inside ZeRO-3's gather: its parameters whole)."""
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp, selected_adapters=[name])
            return cls.read(Path(tmp) / ("" if name == DEFAULT else name), name)

    @classmethod
    def read(cls, path: str | Path, name: str = DEFAULT) -> Adapter:
        """From a directory peft saved one adapter in."""
        return cls({file: (Path(path) / file).read_bytes() for file in (CONFIG, WEIGHTS)}, name)

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        for name, data in self.files.items():
            (path / name).write_bytes(data)
        return path

    def config(self):
        """peft's LoraConfig, for inference (no trainable parameters)."""
        import peft

        config = peft.LoraConfig.from_peft_type(**json.loads(self.files[CONFIG]))  # as peft reads its own file
        config.inference_mode = True
        return config

    def tensors(self) -> dict:
        from safetensors.torch import load

        return load(self.files[WEIGHTS])

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(t.shape) for name, t in self.tensors().items()}


def read_all(path: str | Path) -> tuple[Adapter, ...]:
    """Every adapter of a directory peft saved a model's adapters in (a checkpoint's adapter/): `default` at its
    root, the others in subdirectories named after them."""
    path = Path(path)
    named = [Adapter.read(d, d.name) for d in sorted(path.iterdir()) if (d / CONFIG).is_file()]
    return ((Adapter.read(path),) if (path / CONFIG).is_file() else ()) + tuple(named)


class AdapterPublisher:
    """Rank 0's publisher under learner.lora: `policy` is the learner's lora.Merged view of the adapted model; every
    adapter it holds is published."""

    def publish(self, version: int, policy) -> list:
        return [ray.put(tuple(Adapter.of(policy.model, name) for name in policy.model.peft_config))]

    def close(self) -> None:
        pass
