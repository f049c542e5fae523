"""Dynamic sampling (DAPO): a group whose rollouts all earned the same return gives every transition a zero
advantage, no learning signal (the learner leaves it out, unless a KL or entropy term is in the loss), so the batch
shrinks, and the gradient gets noisier, as more tasks become always solved or never solved. With
algorithm.dynamic_sampling such groups are dropped and new tasks rolled out in further rounds, one per group missing,
until the batch has rollout.tasks_per_iteration groups with a signal or algorithm.max_sampling_rounds rounds have
run."""

from __future__ import annotations

from collections.abc import Callable

from lightning_ray.algorithm.advantages import has_signal
from lightning_ray.types import Task, Transition


def sample_groups(tasks: list[Task], wanted: int, max_rounds: int, run: Callable[[list[Task]], list[Transition]],
                  estimator: str = "grpo") -> tuple[list[Transition], dict]:
    """`run` rolls out a group per task and returns its transitions with their advantages. The first round runs
    the first `wanted` of `tasks`; each further round the next ones (no task twice), one per group still missing.
    Returns every transition made and the counts for metrics.jsonl; at most `wanted` groups have a signal."""
    transitions: list[Transition] = []
    signal: set[str] = set()
    used = rounds = 0
    while rounds < max_rounds and len(signal) < wanted and used < len(tasks):
        batch = tasks[used: used + wanted - len(signal)]
        used, rounds = used + len(batch), rounds + 1
        made = run(batch)
        transitions += made
        signal |= {t.group_id for t in made if has_signal(t, estimator)}
    return transitions, {"sampling_rounds": rounds, "groups_with_signal": len(signal),
                         "groups_dropped": used - len(signal)}
