"""The policy-gradient loss: how it is aggregated over tokens, and the clipped surrogate (advantages come from
algorithm/advantages.py)."""

from __future__ import annotations

import numpy as np
import torch

from lightning_ray.config import LossAggregation
from lightning_ray.types import Transition


def token_weights(transitions: list[Transition], aggregation: LossAggregation, max_tokens: int) -> list[np.ndarray]:
    """The weight of each action token of each transition in the batch loss, so that the loss is one sum over all
    tokens whatever the micro-batches and ranks it is split into. The unit is the policy call: a trajectory's merged
    calls (Transition.call_tokens) weigh what they would as separate transitions, so both levels give one gradient."""
    calls = [t.call_tokens or [t.action_tokens] for t in transitions]
    # a call with no action token (a grammar forced each one: Transition.constrained) weighs nothing and counts not
    n, tokens = sum(k > 0 for c in calls for k in c), sum(map(sum, calls))

    def weight(k: int) -> float:  # of each token of a call with k of them
        if aggregation == "token_mean":
            return 1.0 / tokens
        if aggregation == "sequence_mean":
            return 1.0 / (k * n)
        if aggregation == "token_sum":
            return 1.0 / (max_tokens * n)
        raise ValueError(f"unknown loss aggregation {aggregation!r}")

    return [np.repeat(np.array([weight(k) if k else 0.0 for k in c], np.float32), c) for c in calls]


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor,
                clip_eps: float, clip_eps_high: float | None = None,
                is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """PPO-clip surrogate, summed over tokens with their weights. All tensors are flat, one entry per token.
    clip_eps_high > clip_eps (clip-higher) leaves more room to raise unlikely tokens, against entropy collapse.
    is_weights: importance weights of the tokens for the policy that sampled them (truncated_is_weights)."""
    low, high = 1 - clip_eps, 1 + (clip_eps if clip_eps_high is None else clip_eps_high)
    ratio = torch.exp(logprobs - old_logprobs)
    surrogate = torch.minimum(ratio * advantages, torch.clamp(ratio, low, high) * advantages)
    if is_weights is not None:
        surrogate = surrogate * is_weights
    loss = -(surrogate * weights).sum()
    with torch.no_grad():  # 0-dim tensors, read once a step: a read per micro-batch would stall the GPU's queue
        n = max(len(ratio), 1)
        stats = {"clip_frac": ((ratio < low) | (ratio > high)).float().sum() / n, "ratio_mean": ratio.sum() / n}
    return loss, stats


def truncated_is_weights(learner_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                         cap: float) -> torch.Tensor:
    """min(π_learner / π_sampler, cap) per token, no gradient: corrects the surrogate's expectation for tokens that
    another policy sampled (an older version, or the serving engine's slightly different numerics), and the cap
    bounds the variance a rare token could add. The sampler's logprobs are the distribution it drew from (the
    call's temperature and nucleus), the learner's at the same temperature."""
    return torch.exp(learner_logprobs - sampler_logprobs).clamp(max=cap).detach()


def kl_to_reference(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' logprobs under both (Schulman's
    estimators): k1 = log π − log π_ref, unbiased but can go negative; k3 = r − log r − 1 with r = π_ref / π,
    always ≥ 0 and lower-variance."""
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k3":
        return torch.exp(log_ratio) - log_ratio - 1
    raise ValueError(f"unknown KL estimator {estimator!r}: expected k1 or k3")
