"""LoRA's weight sync (learner.lora): the adapter alone goes to the engines — a few MB where the merged weights are
the whole model — and they apply it on the base they loaded (peft in the HF engine, vLLM's LoRA support). It travels
as peft saves it, so both engines read their usual format; through the object store, whatever the transport: it is
small enough on any hardware."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import ray

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@dataclass(frozen=True)
class Adapter:
    """peft's two files of a LoRA adapter, in memory."""

    files: dict[str, bytes]

    @classmethod
    def of(cls, model) -> Adapter:
        """A peft model's active adapter (inside ZeRO-3's gather: its parameters whole)."""
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            return cls.read(tmp)

    @classmethod
    def read(cls, path: str | Path) -> Adapter:
        """From a directory peft saved (a checkpoint's adapter/)."""
        return cls({name: (Path(path) / name).read_bytes() for name in (CONFIG, WEIGHTS)})

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


class AdapterPublisher:
    """Rank 0's publisher under learner.lora: `policy` is the learner's lora.Merged view of the adapted model."""

    def publish(self, version: int, policy) -> list:
        return [ray.put(Adapter.of(policy.model))]

    def close(self) -> None:
        pass
