"""GRPO: group-relative advantages, how the loss is aggregated over tokens, and the clipped policy-gradient loss."""

from __future__ import annotations

from collections import defaultdict
from statistics import mean, pstdev

import torch

from lightning_ray.config import LossAggregation
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


def token_weights(transitions: list[Transition], aggregation: LossAggregation, max_tokens: int) -> list[float]:
    """The weight of each response token of each transition in the batch loss, so that the loss is one sum over
    all tokens whatever the micro-batches and ranks it is split into. Transitions with zero advantage carry no
    gradient and are not in the batch, so they do not dilute the others' tokens."""
    tokens = sum(t.action_tokens for t in transitions)
    if aggregation == "token_mean":
        return [1.0 / tokens] * len(transitions)
    if aggregation == "sequence_mean":
        return [1.0 / (t.action_tokens * len(transitions)) for t in transitions]
    if aggregation == "token_sum":
        return [1.0 / (max_tokens * len(transitions))] * len(transitions)
    raise ValueError(f"unknown loss aggregation {aggregation!r}")


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor,
                clip_eps: float) -> tuple[torch.Tensor, dict]:
    """PPO-clip surrogate, summed over tokens with their weights. All tensors are flat, one entry per token."""
    ratio = torch.exp(logprobs - old_logprobs)
    surrogate = torch.minimum(ratio * advantages, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages)
    loss = -(surrogate * weights).sum()
    with torch.no_grad():
        n = max(len(ratio), 1)
        stats = {"clip_frac": ((ratio - 1).abs() > clip_eps).float().sum().item() / n,
                 "ratio_mean": ratio.sum().item() / n}
    return loss, stats
