"""GRPO: group-relative advantages and the clipped policy-gradient loss."""

from __future__ import annotations

from collections import defaultdict
from statistics import mean, pstdev

import torch

from lightning_ray.types import Transition


def group_advantages(transitions: list[Transition], normalize_std: bool = True, eps: float = 1e-6) -> list[Transition]:
    """Each rollout's reward relative to the other rollouts of its task; every transition of a rollout shares it."""
    rollout_reward = {t.rollout_id: (t.group_id, t.reward) for t in transitions}
    groups: dict[str, list[float]] = defaultdict(list)
    for group_id, reward in rollout_reward.values():
        groups[group_id].append(reward)
    out = []
    for t in transitions:
        rewards = groups[t.group_id]
        adv = t.reward - mean(rewards)
        if normalize_std:
            adv /= pstdev(rewards) + eps
        out.append(t.model_copy(update={"advantage": adv}))
    return out


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_eps: float) -> tuple[torch.Tensor, dict]:
    """PPO-clip surrogate, averaged over response tokens. All tensors are [batch, tokens]; advantages broadcast."""
    ratio = torch.exp(logprobs - old_logprobs)
    surrogate = torch.minimum(ratio * advantages, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages)
    tokens = mask.sum().clamp(min=1)
    loss = -(surrogate * mask).sum() / tokens
    with torch.no_grad():
        clipped = ((ratio - 1).abs() > clip_eps).float()
        stats = {"clip_frac": ((clipped * mask).sum() / tokens).item(),
                 "ratio_mean": ((ratio * mask).sum() / tokens).item()}
    return loss, stats
