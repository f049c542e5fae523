"""LoRA in the learner (trainer.lora): low-rank adapters on a frozen base (peft), the base itself as the KL reference
(the adapter switched off: no second model in memory), and the policy as the engines serve it — the adapter merged
into the base's weights, under the base model's own parameter names."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from lightning_ray.config import LoraConfig


def with_adapter(model: torch.nn.Module, lora: LoraConfig) -> torch.nn.Module:
    """`model` with a fresh adapter on its linear layers: only the adapter trains. Its B starts at zero, so the
    policy starts exactly as the base."""
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0,
                                                      target_modules=lora.target_modules))


def is_adapted(model: torch.nn.Module) -> bool:
    import peft

    return isinstance(model, peft.PeftModel)


class AdapterOff:
    """The adapted policy with its adapter switched off, i.e. the frozen base: what `score` takes as the KL
    reference."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def get_decoder(self) -> torch.nn.Module:
        return self.model.get_decoder()

    def __call__(self, **inputs):
        with self.model.disable_adapter():
            return self.model(**inputs)


class Merged:
    """The adapted policy as one plain model: each adapted weight W + (alpha / rank)·B·A, every other weight as
    it is, under the base model's names (what the engines load). Computed afresh on each call, nothing in place: the
    base stays bit-for-bit frozen. Offers what the weight publishers, the digest and a save read."""

    def __init__(self, model: torch.nn.Module):
        from peft.tuners.lora import LoraLayer

        self.base, self.adapter = model.get_base_model(), model.active_adapter
        self.layers = {name: m for name, m in self.base.named_modules() if isinstance(m, LoraLayer)}

    def _merged(self, items: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        with torch.no_grad():
            for name, tensor in items:
                if ".lora_" in name:
                    continue
                owner, base_layer, leaf = name.rpartition(".base_layer.")
                if not base_layer:
                    yield name, tensor.detach()
                    continue
                layer = self.layers[owner]
                if leaf == "weight" and self.adapter in layer.lora_A:
                    tensor = tensor + layer.get_delta_weight(self.adapter).to(tensor.dtype)
                yield f"{owner}.{leaf}", tensor.detach()

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._merged(self.base.named_parameters())

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self._merged(self.base.state_dict().items()))

    def save_pretrained(self, path: Path) -> None:
        self.base.save_pretrained(path, state_dict=self.state_dict())
