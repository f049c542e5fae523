"""Dynamic sampling's rounds, with a fake rollout runner: each task's group has fixed rewards, turned into
advantages by the real estimator, so a group is dropped exactly when its rollouts all scored the same."""

from __future__ import annotations

import pytest

from lightning_ray.algorithm.advantages import compute_advantages
from lightning_ray.algorithm.dynamic_sampling import sample_groups
from lightning_ray.config import ConfigError, validate
from lightning_ray.types import Task, Transition

# the rewards of each task's four rollouts; "=" marks the groups without signal (all the same)
REWARDS = {
    "t0": [1, 0, 0, 1],
    "t1": [1, 1, 1, 1],  # =
    "t2": [0, 0, 0, 0],  # =
    "t3": [0, 1, 0, 0],
    "t4": [0, 0, 0, 0],  # =
    "t5": [1, 1, 0, 1],
    "t6": [1, 0, 0, 0],
}
TASKS = [Task(task_id=name, input={}) for name in REWARDS]


class FakeRunner:
    def __init__(self):
        self.rounds: list[list[str]] = []

    def __call__(self, tasks: list[Task]) -> list[Transition]:
        self.rounds.append([t.task_id for t in tasks])
        transitions = [Transition(rollout_id=f"{t.task_id}/{i}", group_id=f"{t.task_id}@0", span_id=f"{i}",
                                  prompt_ids=[1], response_ids=[2], logprobs=[-1.0], reward=r, policy_version=0)
                       for t in tasks for i, r in enumerate(REWARDS[t.task_id])]
        return compute_advantages(transitions)


@pytest.mark.parametrize("max_rounds, rounds, with_signal", [
    (1, [["t0", "t1", "t2"]], 1),  # dynamic sampling off: one round, t1 and t2 give nothing
    # refill with as many new tasks as groups are missing: 2 (t3 has a signal, t4 not), then 1 (t5): 3 collected
    (3, [["t0", "t1", "t2"], ["t3", "t4"], ["t5"]], 3),
    (2, [["t0", "t1", "t2"], ["t3", "t4"]], 2),  # the rounds ran out one group short
    (9, [["t0", "t1", "t2"], ["t3", "t4"], ["t5"]], 3),  # no round once the batch is full: t6 is never run
])
def test_rounds_refill_the_groups_without_signal(max_rounds, rounds, with_signal):
    run = FakeRunner()
    transitions, stats = sample_groups(TASKS, 3, max_rounds, run)
    assert run.rounds == rounds
    ran = sum(rounds, [])
    assert stats == {"sampling_rounds": len(rounds), "groups_with_signal": with_signal,
                     "groups_dropped": len(ran) - with_signal}
    # every rollout run is returned (metrics count them); the learner takes only the groups with a signal
    assert len(transitions) == 4 * len(ran)
    trained = {t.group_id.split("@")[0] for t in transitions if t.advantage != 0}
    assert trained == {name for name in ran if len(set(REWARDS[name])) > 1}


def test_no_task_runs_twice_when_tasks_run_out():
    run = FakeRunner()
    _, stats = sample_groups(TASKS[:4], 3, 5, run)
    assert run.rounds == [["t0", "t1", "t2"], ["t3"]]  # rounds remained, tasks did not
    assert stats == {"sampling_rounds": 2, "groups_with_signal": 2, "groups_dropped": 2}


def test_with_a_critic_every_group_has_a_signal():
    run = FakeRunner()
    _, stats = sample_groups(TASKS, 3, 3, run, estimator="ppo")  # the value head is the baseline, not the group
    assert run.rounds == [["t0", "t1", "t2"]] and stats["groups_dropped"] == 0


@pytest.mark.parametrize("algorithm, named", [
    ({"dynamic_sampling": True, "max_sampling_rounds": 0}, "algorithm.max_sampling_rounds"),
    ({"dynamic_sampling": True, "estimator": "ppo"}, "algorithm.dynamic_sampling"),
])
def test_dynamic_sampling_options_are_validated(algorithm, named):
    with pytest.raises(ConfigError, match=named):
        validate({"run_dir": "x", "algorithm": algorithm})
