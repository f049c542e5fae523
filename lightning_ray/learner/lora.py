"""LoRA in the learner (learner.lora): low-rank adapters on a frozen base (peft), the base itself as the KL reference
(the adapter switched off: no second model in memory), and the policy as the engines serve it — the adapter merged
into the base's weights, under the base model's own parameter names. With an adapter per agent (algorithm.adapters)
the model holds them all, each micro-batch runs with its calls' one, and each has its own parameter group."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from functools import cached_property
from pathlib import Path

import torch

from lightning_ray.config import LoraConfig
from lightning_ray.weight_sync.adapter import DEFAULT


def with_adapter(model: torch.nn.Module, lora: LoraConfig, names: Sequence[str] = (DEFAULT,)) -> torch.nn.Module:
    """`model` with a fresh adapter of each name on its linear layers: only they train. Their B starts at zero, so
    the policy starts exactly as the base."""
    import peft

    targets, top = lora.target_modules, None
    if lora.layers:  # the top layers only: nothing below the lowest needs a gradient
        depth = model.config.num_hidden_layers
        if lora.layers > depth:
            raise ValueError(f"learner.lora.layers={lora.layers}: the model has {depth} layers")
        top = list(range(depth - lora.layers, depth))
        if targets == "all-linear":  # by name, as peft takes it beside layers_to_transform
            head = model.get_output_embeddings()
            targets = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                              if isinstance(m, torch.nn.Linear) and m is not head})

    def config():
        return peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0, target_modules=targets,
                               layers_to_transform=top)

    model = peft.get_peft_model(model, config(), adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, config())
    trainable(model)
    return model


def adapter_parameters(model: torch.nn.Module, name: str) -> list[torch.nn.Parameter]:
    """One adapter's parameters (peft names them `...q_proj.lora_A.<adapter>.weight`)."""
    own = re.compile(rf"\.lora_[A-Za-z_]+\.{re.escape(name)}\.")
    return [p for n, p in model.named_parameters() if own.search(n)]


def use_adapter(model: torch.nn.Module, name: str) -> None:
    """The forward passes from now on run with this adapter. peft would also freeze the others: they stay
    trainable, each training on the micro-batches of its own calls."""
    if model.active_adapter != name:
        model.set_adapter(name)
        trainable(model)


def trainable(model: torch.nn.Module) -> None:
    """Every adapter trains (peft's add_adapter and set_adapter leave only the active one trainable)."""
    for name in model.peft_config:
        for p in adapter_parameters(model, name):
            p.requires_grad_(True)


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
            out = self.model(**inputs)
        trainable(self.model)  # peft's re-enabling leaves the active adapter alone trainable (a checkpoint saves those)
        return out


class Merged:
    """The adapted policy as one plain model: each adapted weight W + (alpha / rank)·B·A, every other weight as
    it is, under the base model's names (a checkpoint's policy/). Nothing is merged in place: the base stays
    bit-for-bit frozen. Offers what a save reads (and `model`, the adapted one, whose adapters alone are
    published); the merged weights are computed once per view for what reads them all (a save, a publish), one at
    a time for a digest. With an adapter per agent there is no one policy to merge: the view is the base (each
    adapter is saved, and served, on its own)."""

    def __init__(self, model: torch.nn.Module):
        from peft.tuners.lora import LoraLayer

        self.model, self.base = model, model.get_base_model()
        self.adapter = model.active_adapter if len(model.peft_config) == 1 else None
        self.layers = {name: m for name, m in self.base.named_modules()
                       if isinstance(m, LoraLayer) and self.adapter in m.lora_A}

    @cached_property
    def weights(self) -> dict[str, torch.Tensor]:
        return dict(self.named_parameters())

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each merged as it is asked for (a digest holds one at a time), or as `weights` holds them once made."""
        if "weights" in vars(self):
            yield from self.weights.items()
            return
        with torch.no_grad():
            for name, t in _served_names(self.base.named_parameters()):
                layer = self.layers.get(name.removesuffix(".weight")) if name.endswith(".weight") else None
                yield name, t if layer is None else t + layer.get_delta_weight(self.adapter).to(t.dtype)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The parameters, and what else the base's state holds (buffers, a tied LM head's second name)."""
        return {name: self.weights.get(name, t) for name, t in _served_names(self.base.state_dict().items())}

    def save_pretrained(self, path: Path) -> None:
        self.base.save_pretrained(path, state_dict=self.state_dict())


def _served_names(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """peft's names back to the base model's (q_proj.base_layer.weight → q_proj.weight), the adapter's left out."""
    for name, t in items:
        if ".lora_" not in name:
            yield name.replace(".base_layer.", "."), t.detach()
