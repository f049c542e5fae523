"""Whether the learner's model states fit its GPUs, told before DeepSpeed starts: a model too big for the placement
(Qwen2.5-7B on one learner GPU, Llama-3.2-3B beside a colocated engine) would otherwise end in CUDA's out-of-memory
traceback, after the download and the engine's start."""

from __future__ import annotations

import torch

GiB = 2**30


def model_state_bytes(trainable: int, frozen: int, weight_bytes: int, ranks: int, stage: int, offload: bool,
                      reference: bool) -> float:
    """A lower bound of what one rank's GPU holds before any activation, in bytes: the weights in their dtype; the
    gradients accumulated in fp32; Adam's two fp32 moments and, under bf16, the fp32 master weights (host memory with
    offload); a full-size KL reference. ZeRO partitions over the ranks the optimizer state from stage 1, the gradients
    from 2, the weights from 3."""
    part = lambda n, from_stage: n / ranks if stage >= from_stage else n  # noqa: E731
    optimizer = 0 if offload else part(trainable * (8 + (4 if weight_bytes < 4 else 0)), 1)
    weights = (trainable + frozen) * weight_bytes
    return part(weights, 3) + part(trainable * 4, 2) + optimizer + (weights if reference else 0)


def check_fits(model: torch.nn.Module, device: torch.device, ranks: int, stage: int, offload: bool,
               reference: bool) -> None:
    """Raise, naming what to change, where the model states alone pass the GPU's free memory (the engine's share
    already taken where it shares the GPU)."""
    if device.type != "cuda":
        return
    params = list(model.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    need = model_state_bytes(trainable, sum(p.numel() for p in params) - trainable, params[0].element_size(), ranks,
                             stage, offload, reference)
    free, total = torch.cuda.mem_get_info(device)
    if need > free:
        raise MemoryError(
            f"the learner's weights, gradients and optimizer state need at least {need / GiB:.1f} GiB on each of its "
            f"{ranks} GPU(s) (learner.zero_stage={stage}), before activations; {free / GiB:.1f} of {total / GiB:.1f} "
            "GiB are free: train on more GPUs with ZeRO-3 (placement=eight_gpus, or learner.num_workers with "
            "learner.zero_stage=3), keep the optimizer on the host (learner.offload_optimizer=true), or train LoRA "
            "adapters (learner.lora={})")
