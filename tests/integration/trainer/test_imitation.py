"""Imitation, the warm start before RL, end to end on the real stack (jobs/imitate.py, then jobs/train.py
model.path=...): the calc task's oracle answers the training rollouts behind the same endpoint, the episodes are
recorded in the store, one SFT step trains on them through Ray Train + DeepSpeed, and RL goes on from the checkpoint
the imitation run wrote, with no teacher. A teacher that errs (the tiny model itself, sampling) has its episodes
filtered by reward.

The RL run also stands for any run's time budget and pass@k evaluation (trainer.max_minutes, eval.pass_k): a run
start is most of a test's time on this machine, so one run checks what needs no run of its own."""

from __future__ import annotations

import json
import sqlite3
from collections import defaultdict

import pytest
from helpers import small

from lightning_ray.learner.checkpoint import latest
from lightning_ray.models.tiny import EASY
from lightning_ray.store.sqlite import SQLiteBackend
from lightning_ray.tracing import semconv
from lightning_ray.trainer import train


def config(run_dir, model_path, serve_port, **raw):
    return small({"run_dir": str(run_dir), "model": {"path": str(model_path)}, "serve": {"port": serve_port},
                  "task": {"generator": EASY, "eval_size": 4},
                  "trainer": {"iterations": 1, "eval_every": 1}, "learner": {"lr": 1e-3},
                  **raw})


def calls(run_dir):
    return [s for s in SQLiteBackend(run_dir / "traces.sqlite").query_spans() if s.name == semconv.LLM_CALL]


def training(spans):  # held-out evaluation decodes greedily, training at the rollout temperature (1.0)
    return [s for s in spans if s.attributes[semconv.SAMPLING]["temperature"] > 0]


@pytest.fixture(scope="module")
def runs(ray_cluster, tiny_model_path, serve_port, tmp_path_factory):
    imitated, reinforced, sampled = (tmp_path_factory.mktemp(name) for name in ("imitate", "rl", "sampled"))
    # evaluated after its iteration only (trainer.eval_before=false): what RL starts from
    imitation = train(config(imitated, tiny_model_path, serve_port, teacher={"kind": "oracle"},
                             algorithm={"objective": "sft"}, rollout={"tasks_per_iteration": 6, "group_size": 1},
                             trainer={"iterations": 1, "eval_every": 1, "eval_before": False}))
    # a time budget spent within the first of 50 iterations, which is then the last: evaluated (with pass@2 besides)
    # and checkpointed as the last of `iterations` would be, though eval_every and checkpoint_every are 40
    rl = train(config(reinforced, imitated / "checkpoint", serve_port, rollout={"group_size": 4}, eval={"pass_k": 2},
                      trainer={"iterations": 50, "max_minutes": 1e-3, "eval_every": 40, "checkpoint_every": 40}))
    # the tiny model sampling at 1.2 is right about half the time (0.53 of 60 episodes; at 1.0, 0.75: all 16 right in
    # ~1% of runs, which failed CI): some of the 16 episodes pass the bar and some fail, except in ~3e-5 of runs
    teacher = {"kind": "model", "path": str(tiny_model_path), "temperature": 1.2, "max_tokens": 32}
    erring = train(config(sampled, tiny_model_path, serve_port, teacher=teacher, algorithm={"objective": "sft"},
                          rollout={"tasks_per_iteration": 8, "group_size": 2},
                          trainer={"iterations": 1, "eval_every": 0}))
    return {"imitation": imitation, "rl": rl, "erring": erring, "imitated": imitated, "reinforced": reinforced,
            "sampled": sampled}


def test_the_teacher_answers_the_training_rollouts_and_never_the_held_out_ones(runs):
    spans = calls(runs["imitated"])
    taught, held_out = training(spans), [s for s in spans if s not in training(spans)]
    assert taught and held_out
    assert all(s.attributes.get(semconv.TEACHER) == "oracle:calc" for s in taught)
    assert not any(semconv.TEACHER in s.attributes for s in held_out)
    # the oracle's episodes: the calculator call with the generator's expression, then the answer
    assert {s.attributes[semconv.RESPONSE_TEXT].split()[0] for s in taught} == {"CALC", "ANSWER"}


def test_the_oracles_episodes_are_kept_and_trained_on_as_the_policys_tokens(runs):
    [h] = runs["imitation"]
    assert h["reward_mean"] == 1.0  # every episode the oracle answered is right: all pass sft_min_reward
    assert h["transitions"] == h["llm_spans"] == len(training(calls(runs["imitated"]))) > 0
    assert h["updated"] and h["policy_version"] == 1 and h["trained_tokens"] > 0
    # the engine scored the teacher's tokens as the learner does: the forced tokens' logprobs are the policy's
    assert h["logprob_abs_diff"] < 1e-3
    assert (runs["imitated"] / "checkpoint" / "config.json").exists()
    # trainer.eval_before=false: the 4 held-out problems were evaluated once, after the update
    assert "eval_before" not in h and h["eval"]["after"] == 1 and h["eval"]["tasks"] == 4
    rollouts = SQLiteBackend(runs["imitated"] / "traces.sqlite").query_rollouts()
    assert len([r for r in rollouts if r.task.group_id is None]) == 4  # the held-out ones (no GRPO group)


def test_rl_goes_on_from_the_imitation_checkpoint_without_the_teacher(runs):
    [h] = runs["rl"]
    assert h["rollouts"] == 16 and not any(semconv.TEACHER in s.attributes for s in calls(runs["reinforced"]))
    # it trains when its samples differ: groups of 4 all alike (every answer right, or wrong) are rare, not impossible
    assert h["updated"] == (h["groups_with_signal"] > 0)
    # the RL run starts from the weights imitation ended with: greedy held-out answers, the same problems
    before_rl, after_imitation = runs["rl"][0]["eval_before"], runs["imitation"][-1]["eval"]
    assert before_rl["accuracy"] == after_imitation["accuracy"]
    assert before_rl["reward_mean"] == after_imitation["reward_mean"]


def test_a_teachers_episodes_below_the_bar_are_left_out(runs):
    """The sft objective keeps each group's best episode if it reached algorithm.sft_min_reward (1.0)."""
    [h] = runs["erring"]
    rollouts = SQLiteBackend(runs["sampled"] / "traces.sqlite").query_rollouts()
    spans = training(calls(runs["sampled"]))
    assert spans and all(s.attributes[semconv.TEACHER].startswith("model:") for s in spans)
    best: dict[str, float] = {}
    for r in rollouts:
        best[r.task.group_id] = max(best.get(r.task.group_id, r.reward), r.reward)
    kept = {r.rollout_id for r in rollouts if r.reward == best[r.task.group_id] >= 1.0}
    assert 0 < len(kept) < len(rollouts)  # the sampling teacher was right in some episodes, wrong in others
    assert h["groups_with_signal"] == sum(b >= 1.0 for b in best.values())
    # only the kept episodes' tokens were trained on (every call's answer, at algorithm.level=transition)
    assert h["trained_tokens"] == sum(len(s.attributes[semconv.COMPLETION_TOKEN_IDS]) for s in spans
                                      if s.rollout_id in kept)


def test_a_time_budget_ends_training_with_the_final_evaluation(runs):
    """trainer.max_minutes: the iteration running when the budget runs out is the last, evaluated and checkpointed as
    the last of `iterations` would be."""
    history = runs["rl"]
    assert [h["iteration"] for h in history] == [0]
    assert history[0]["eval_before"]["tasks"] == history[0]["eval"]["tasks"] == 4
    # checkpointed as the last iteration, whether or not it trained (its version then 0)
    assert (runs["reinforced"] / "checkpoint").is_dir()
    assert latest(runs["reinforced"]).state.next_iteration == 1


def test_pass_at_k_is_over_k_samples_of_each_held_out_problem(runs):
    """eval.pass_k=2: after the greedy rollouts, two per problem at the rollout temperature; a problem passes if
    either is right. Recomputed from the store: the evaluations' sampled rollouts (no group, temperature 1), the
    last 8 being the final evaluation's."""
    run_dir = runs["reinforced"]
    rollouts = [{"rollout_id": r[0], "task": json.loads(r[1]), "reward": r[2]} for r in sqlite3.connect(
        run_dir / "traces.sqlite").execute("SELECT rollout_id, task, reward FROM rollouts ORDER BY enqueued_at, seq")]
    temperature = {s.rollout_id: s.attributes[semconv.SAMPLING]["temperature"] for s in calls(run_dir)}
    sampled = [r for r in rollouts if r["task"]["group_id"] is None and temperature[r["rollout_id"]] == 1.0]
    assert len(sampled) == 2 * 4 * 2  # before and after training, 4 problems, 2 samples each
    by_task = defaultdict(list)
    for r in sampled[8:]:
        by_task[r["task"]["task_id"]].append(r["reward"] is not None and r["reward"] >= 1)
    final = runs["rl"][-1]["eval"]
    assert len(by_task) == 4 and all(len(right) == 2 for right in by_task.values())
    assert final["pass@2"] == sum(any(right) for right in by_task.values()) / 4
    assert final["mean@2"] == sum(sum(right) for right in by_task.values()) / 8
    assert "pass@2" in runs["rl"][0]["eval_before"]
