"""Held-out evaluation through the same server and the same unmodified agent as training.

Greedy accuracy: one rollout per task, sampled at temperature 0 (the task's sampling defaults tell the server; the
agent is not touched). pass@k: k rollouts per task at the training temperature; a task passes if any is right.
A rollout is right when the task's reward is 1 (scorers may give partial credit below that). Rollouts that failed
for the platform's reasons (no reward) count as wrong and are reported. With task.balance, the greedy accuracy of each
of its values too (sql: of each question family).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import TYPE_CHECKING

from lightning_ray.metrics import metrics
from lightning_ray.services import Services
from lightning_ray.trainer.record import common_errors, most_often
from lightning_ray.types import Rollout, Task

if TYPE_CHECKING:  # a run's TensorBoard writer imports torch (~2 s): `lightning-ray eval` needs neither
    from lightning_ray.trainer.run import Run


def evaluate(services: Services, tasks: list[Task], pass_k: int = 0, desc: str = "eval") -> dict:
    greedy = services.run_rollouts([t.model_copy(update={"sampling": {"temperature": 0.0}}) for t in tasks],
                                   f"{desc} greedy")
    result = {"tasks": len(tasks), "accuracy": _solved(greedy) / len(tasks),
              "reward_mean": sum(r.reward or 0.0 for r in greedy) / len(greedy),
              "failed_rollouts": sum(r.reward is None for r in greedy)}
    if errors := common_errors(greedy):  # an accuracy of agents that failed is not the policy's: said beside it
        result["rollout_errors"] = errors
    if key := services.cfg.task.balance:  # each kind of task's accuracy: what training gained or lost, and where
        kinds: dict[str, list[Rollout]] = defaultdict(list)
        for r in greedy:
            kinds[str(r.task.input[key])].append(r)
        result["accuracy_by"] = {kind: _solved(rs) / len(rs) for kind, rs in sorted(kinds.items())}
    metrics().held_out_accuracy.set(result["accuracy"])
    if pass_k:
        temperature = services.cfg.rollout.temperature
        sampled = services.run_rollouts([t.model_copy(update={"sampling": {"temperature": temperature}})
                                         for t in tasks for _ in range(pass_k)], f"{desc} pass@{pass_k}")
        by_task: dict[str, list[Rollout]] = defaultdict(list)
        for r in sampled:
            by_task[r.task.task_id].append(r)
        result[f"pass@{pass_k}"] = sum(_solved(rs) > 0 for rs in by_task.values()) / len(tasks)
        result[f"mean@{pass_k}"] = _solved(sampled) / len(sampled)  # accuracy of one sample at that temperature
    return result


def failures(result: dict) -> str:
    """What the accuracy's line says of the evaluation's failed rollouts (the agent's and the platform's)."""
    if not (errors := result.get("rollout_errors")):
        return ""
    return f" ({sum(errors.values())} of {result['tasks']} rollouts failed, most often: {most_often(errors)})"


def evaluate_held_out(run: Run, after: int) -> dict:
    """The held-out split, after `after` iterations, kept with the run's evaluations."""
    start = time.perf_counter()
    with run.phase("eval"):
        result = {"after": after, **evaluate(run.services, run.held_out, run.cfg.eval.pass_k,
                                             f"eval after {after}" if after else "eval before")}
    result["seconds"] = round(time.perf_counter() - start, 3)  # the one before training is in no iteration's
    run.evals.append(result)
    return result


def _solved(rollouts: list[Rollout]) -> int:
    return sum(r.reward is not None and r.reward >= 1.0 for r in rollouts)
