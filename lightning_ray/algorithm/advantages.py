"""Credit assignment and advantage estimators: from rewards to one advantage per policy call.

Credit assignment gives each step t of an episode (its t-th policy call) a return G_t from the episode's final
reward R and the intermediate rewards r_t credited to that step (rewards recorded after call t, before call t+1):
  terminal    G_t = R for every step (the paper's simplest form: the final reward, broadcast)
  per_step    G_t = r_t, plus R at the last step (each step judged by what it alone earned)
  discounted  G_t = r_t + γ G_{t+1}, R added to the last step's r (later rewards flow back, shrunk by γ)

A group method compares each return with a baseline from the other rollouts of the same task:
  group   the rollouts' average returns (with terminal credit: their final rewards, as GRPO does)
  turn    the returns of the same step t in the other rollouts (step-level GRPO); a step only one rollout reached
          falls back to the group baseline

and the estimator turns return and baseline into an advantage:
  grpo          (G - mean) / (std + eps), std the spread of the returns compared with the baseline
  dr_grpo       G - mean (Dr. GRPO: no std scaling, which over-weights groups that nearly agree)
  rloo          G - mean of the other rollouts (leave-one-out)
  reinforce_pp  G - mean, scaled by the std of the whole batch (REINFORCE++ with a group baseline); rescaling
                only, so a group whose rollouts agree still gives no signal
  ppo           no group baseline: the learner's value head is the baseline, token by token (GAE, algorithm/ppo.py);
                each transition carries its return G for it, and every transition has a signal

With algorithm.objective=sft none of this applies: best_rollouts picks each group's best rollout(s) to imitate.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from statistics import mean, pstdev

from lightning_ray.types import Transition

logger = logging.getLogger(__name__)


def step_returns(steps: list[Transition], credit: str, gamma: float = 1.0) -> list[float]:
    """The returns of one rollout's transitions, given in step order."""
    if not steps:
        return []
    if credit == "terminal":
        return [steps[-1].reward] * len(steps)
    rewards = [t.step_reward for t in steps]
    rewards[-1] += steps[-1].reward
    if credit == "per_step":
        return rewards
    if credit == "discounted":
        out, g = [], 0.0
        for r in reversed(rewards):
            g = r + gamma * g
            out.append(g)
        return out[::-1]
    raise ValueError(f"unknown credit assignment {credit!r}: expected terminal, per_step or discounted")


def compute_advantages(transitions: list[Transition], estimator: str = "grpo", credit: str = "terminal",
                       gamma: float = 1.0, baseline: str = "group", eps: float = 1e-6) -> list[Transition]:
    """Every transition with its advantage (input: any order; each rollout's steps numbered by `step`). A rollout
    whose returns are not all finite (a NaN or infinite reward that got past the adapter) is left out of the batch,
    and out of its group's baseline, which it would turn into NaN for every other rollout of the group."""
    by_rollout: dict[str, list[Transition]] = defaultdict(list)
    for t in transitions:
        by_rollout[t.rollout_id].append(t)
    returns: dict[tuple[str, int], float] = {}
    for rollout_id, steps in list(by_rollout.items()):
        steps.sort(key=lambda t: t.step)
        gs = step_returns(steps, credit, gamma)
        if not all(map(math.isfinite, gs)):
            logger.warning("rollout %s has a return that is not finite (%s): left out of the batch", rollout_id, gs)
            del by_rollout[rollout_id]
            continue
        returns.update({(rollout_id, t.step): g for t, g in zip(steps, gs)})
    transitions = [t for t in transitions if t.rollout_id in by_rollout]
    # baseline pools: per group, each rollout's average return; per (group, step), each rollout's return there
    group_pool: dict[str, dict[str, float]] = defaultdict(dict)
    turn_pool: dict[tuple[str, int], dict[str, float]] = defaultdict(dict)
    for rollout_id, steps in by_rollout.items():
        group = steps[0].group_id
        group_pool[group][rollout_id] = mean(returns[rollout_id, t.step] for t in steps)
        for t in steps:
            turn_pool[group, t.step][rollout_id] = returns[rollout_id, t.step]

    # grpo's scale for a group baseline: the spread of the returns it is compared with, each rollout weighing one
    # (under terminal credit, the std of the final rewards); the std of the averages would divide a step's return by
    # ~0 when the rollouts' averages agree but their steps' returns do not (every rollout solved in two calls: per-step
    # returns 0 then 1, averages all 0.5)
    group_spread = {group: math.sqrt(mean(mean((returns[r, t.step] - mean(averages.values())) ** 2
                                               for t in by_rollout[r]) for r in averages))
                    for group, averages in group_pool.items()}

    def pool(t: Transition) -> tuple[dict[str, float], float]:
        """The returns of the baseline, and their spread."""
        if baseline == "turn" and len(turn_pool[t.group_id, t.step]) > 1:
            return turn_pool[t.group_id, t.step], pstdev(turn_pool[t.group_id, t.step].values())
        if baseline in ("group", "turn"):
            return group_pool[t.group_id], group_spread[t.group_id]
        raise ValueError(f"unknown baseline {baseline!r}: expected group or turn")

    if estimator == "ppo":
        return [t.model_copy(update={"returns": returns[t.rollout_id, t.step]}) for t in transitions]
    advantages = [_advantage(returns[t.rollout_id, t.step], *pool(t), t.rollout_id, estimator, eps)
                  for t in transitions]
    if estimator == "reinforce_pp" and len(advantages) > 1:
        scale = pstdev(advantages) + eps
        advantages = [a / scale for a in advantages]
    if not all(map(math.isfinite, advantages)):  # finite returns, yet an overflow: rewards far out of any sane range
        raise ValueError(f"advantages overflowed to {sorted(set(advantages))[:5]}: rewards must be finite and of a "
                         f"sane scale (returns {sorted(set(returns.values()))[:5]})")
    return [t.model_copy(update={"advantage": a, "returns": returns[t.rollout_id, t.step]})
            for t, a in zip(transitions, advantages)]


def has_signal(t: Transition, estimator: str) -> bool:
    """Whether a transition can move the policy: with a critic (ppo) every one can, its advantages coming from the
    value head; with a group baseline only one whose return differs from it."""
    return estimator == "ppo" or t.advantage != 0


def _advantage(g: float, pool: dict[str, float], spread: float, own: str, estimator: str, eps: float) -> float:
    values = list(pool.values())
    if estimator == "grpo":
        return (g - mean(values)) / (spread + eps)
    if estimator in ("dr_grpo", "reinforce_pp"):
        return g - mean(values)
    if estimator == "rloo":
        others = [v for r, v in pool.items() if r != own]
        return g - mean(others) if others else 0.0
    raise ValueError(f"unknown advantage estimator {estimator!r}: expected grpo, dr_grpo, rloo, reinforce_pp or ppo")


def best_rollouts(transitions: list[Transition], min_reward: float) -> list[Transition]:
    """Rejection-sampling fine-tuning (algorithm.objective=sft): in each group, the transitions of the rollout(s)
    with the group's highest final reward, if it is at least `min_reward`, get advantage 1; all others 0, which
    leaves them out of the batch. At the learner's ratio of 1 (one on-policy step) the PPO-clip surrogate
    min(r·A, clip(r)·A) with A = 1 has the gradient ∇r = ∇log π: the loss's gradient is exactly that of the
    negative log-likelihood of the kept tokens, aggregated as algorithm.loss_aggregation says.

    Every transition is scored at temperature 1 (score_temperature): SFT maximizes the samples' likelihood under
    the model itself, softmax(logits), as fine-tuning on any data does; the sampling temperature τ only chose which
    answers were drawn, and scoring at it would fit softmax(logits / τ) instead. Their served logprobs, at τ, are
    then neither compared with the learner's nor importance-weighted by."""
    best: dict[str, float] = {}
    for t in transitions:
        best[t.group_id] = max(best.get(t.group_id, t.reward), t.reward)
    return [t.model_copy(update={"advantage": float(t.reward == best[t.group_id] >= min_reward),
                                 "score_temperature": 1.0}) for t in transitions]
