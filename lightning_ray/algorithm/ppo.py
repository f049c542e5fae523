"""PPO's critic side: token-level rewards, generalized advantage estimation (GAE) against a learned value, and the
value loss. The policy side (the clipped surrogate) is the same as the group methods' (algorithm/loss.py).

Each sample's action tokens are the steps of a small MDP whose state is the context so far:
  reward   r_k = −kl_coef · KL_k at every token (with algorithm.kl_penalty=reward), plus the sample's return G
           (algorithm.credit's, from algorithm/advantages.py) at its last action token
  value    V_k, the value head's estimate at the position that predicts action token k
  GAE      δ_k = r_k + V_{k+1} − V_k (V after the last token: 0, the sample ends there)
           A_k = δ_k + λ A_{k+1}, discounting only by λ (γ = 1 within a call: tokens are not time)
  target   the value head learns R_k = A_k + V_k
Advantages are then whitened over the whole batch (every rank's tokens), as PPO does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def token_rewards(sample_return: float, tokens: int, kl: torch.Tensor | None = None,
                  kl_coef: float = 0.0) -> torch.Tensor:
    """One sample's per-token rewards: its return on the last action token, the KL penalty on every one."""
    rewards = torch.zeros(tokens) if kl is None else -kl_coef * kl.detach().float()
    if tokens:
        rewards[-1] += sample_return
    return rewards


def gae(rewards: torch.Tensor, values: torch.Tensor, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One sample's advantages and value targets (1-D, one entry per action token, in order)."""
    r, v = rewards.tolist(), values.tolist()  # a Python loop over floats: ~50× faster than tensor indexing
    advantages, running, next_value = [0.0] * len(r), 0.0, 0.0
    for k in reversed(range(len(r))):
        running = r[k] + next_value - v[k] + lam * running
        advantages[k], next_value = running, v[k]
    advantages = torch.tensor(advantages, dtype=values.dtype, device=values.device)
    return advantages, advantages + values


def whiten(x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x − mean) / std over every rank's entries: each rank holds part of the batch, and a per-rank scale would
    weigh the same advantage differently on different ranks. Every rank must call it (a collective)."""
    # on x's device: NCCL reduces only CUDA tensors
    stats = torch.tensor([x.sum().item(), (x * x).sum().item(), float(x.numel())], dtype=torch.float64, device=x.device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(stats)
    total, squares, n = stats.tolist()
    if n == 0:
        return x
    mean = total / n
    std = max(squares / n - mean * mean, 0.0) ** 0.5
    return (x - mean) / (std + eps)


def value_loss(values: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """½ (V − R)², summed with the tokens' loss weights. Unclipped: PPO's value clipping (against the values that
    made the targets) matters only from a batch's second step on (algorithm.ppo_epochs, mini_batches), and is left
    out."""
    return 0.5 * ((values - targets) ** 2 * weights).sum()
