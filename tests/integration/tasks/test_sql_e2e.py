"""Two iterations of the whole loop on the sql task with agent selection: Ray, Serve with the HF engine, rollout
workers running the LangGraph workflow, the SQLite trace store, LightningRL with `algorithm.select.agents`, Ray Train.

The tiny test model was warmed up on arithmetic, so its SQL is garbage and its rewards are ~0 (no group may carry a
signal, so no update need happen): what is checked is the plumbing."""

from __future__ import annotations

import json
import sqlite3
from collections import Counter

import pytest
from helpers import small

from lightning_ray.algorithm.select import agent_of
from lightning_ray.tasks import sql
from lightning_ray.trainer import train
from lightning_ray.types import Span, Task

ROLLOUTS_PER_ITERATION = 4 * 2


@pytest.fixture(scope="module")
def run(ray_cluster, tiny_model_path, serve_port, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("sql-run")
    cfg = small({
        "run_dir": str(run_dir),
        "model": {"path": str(tiny_model_path)},
        # the schema in every prompt is ~900 of the tiny model's tokens: its rotary positions extend past 512
        "engine": {"kind": "hf", "max_model_len": 2048},
        "serve": {"port": serve_port},
        "task": {"name": "sql", "dataset": "chinook", "generator": {"max_rounds": 1}, "train_size": 16,
                 "eval_size": 4, "balance": "family"},
        "rollout": {"tasks_per_iteration": 4, "group_size": 2, "max_tokens": 24, "agents_per_worker": 4},
        # one sample per selected call, so transitions count the writer's and the rewriter's calls
        "algorithm": {"select": {"agents": ["writer", "rewriter"]}, "level": "transition"},
        "trainer": {"iterations": 2, "eval_every": 2},
        "learner": {"num_workers": 1, "threads_per_worker": 1, "micro_batch_tokens": 4096},
    })
    history = train(cfg)
    db = sqlite3.connect(run_dir / "traces-spans.sqlite")
    spans = [Span(span_id=r[0], trace_id=r[1], parent_id=r[2], rollout_id=r[3], attempt_id=r[4], name=r[5],
                  start_time=r[6], attributes=json.loads(r[7]), origin=r[8])
             for r in db.execute("SELECT span_id, trace_id, parent_id, rollout_id, attempt_id, name, start_time, "
                                 "attributes, origin FROM spans WHERE rollout_id IS NOT NULL")]
    rollouts = {r[0]: (Task.model_validate_json(r[1]), r[2], r[3]) for r in sqlite3.connect(
        run_dir / "traces.sqlite").execute("SELECT rollout_id, task, status, reward FROM rollouts ORDER BY seq")}
    held_out = [rollouts.pop(rid) for rid, (task, _, _) in list(rollouts.items()) if task.group_id is None]
    return {"history": history, "spans": [s for s in spans if s.rollout_id in rollouts], "rollouts": rollouts,
            "held_out": held_out}


def test_rollouts_ran_the_workflow_to_an_answer(run):
    assert [h["iteration"] for h in run["history"]] == [0, 1]
    for h in run["history"]:
        assert h["rollouts"] == ROLLOUTS_PER_ITERATION
        assert h["failed_rollouts"] == h["infra_failed_rollouts"] == 0
    assert len(run["rollouts"]) == 2 * ROLLOUTS_PER_ITERATION
    assert {status for _, status, _ in run["rollouts"].values()} == {"succeeded"}


def test_every_call_nests_under_its_agent(run):
    by_rollout: dict[str, list[Span]] = {}
    for s in run["spans"]:
        by_rollout.setdefault(s.rollout_id, []).append(s)
    for rid, spans in by_rollout.items():
        by_id = {s.span_id: s for s in spans}
        calls = sorted((s for s in spans if s.name == "llm.call" and s.origin == "server"), key=lambda s: s.start_time)
        agents = [agent_of(c, by_id) for c in calls]
        assert agents in (["writer", "checker"], ["writer", "checker", "rewriter", "checker"])  # max_rounds=1
        # the tool spans and the agent spans from the worker's process reached the store with the server's
        assert sum(s.name == "execute_tool execute_sql" for s in spans) == agents.count("checker")


def test_only_the_writer_and_the_rewriter_calls_became_transitions(run):
    calls = [s for s in run["spans"] if s.name == "llm.call" and s.origin == "server"]
    by_id = {s.span_id: s for s in run["spans"]}
    made_by = Counter(agent_of(c, by_id) for c in calls)
    assert made_by["checker"] >= 2 * ROLLOUTS_PER_ITERATION  # at least one check per rollout
    history = run["history"]
    assert sum(h["llm_spans"] for h in history) == len(calls)  # every recorded call, the checker's included ...
    # ... of which the writer's and the rewriter's were trained: one transition each, none of the checker's
    assert sum(h["transitions"] for h in history) == sum(h["policy_calls"] for h in history) \
        == made_by["writer"] + made_by["rewriter"] < len(calls)
    assert made_by["writer"] == 2 * ROLLOUTS_PER_ITERATION


def test_rewards_are_execution_matches_of_the_final_query(run):
    answers = {s.rollout_id: s.attributes.get("answer") for s in run["spans"] if s.name == "rollout"}
    rewards = [s.attributes["lightning_ray.reward"] for s in run["spans"] if s.name == "reward"]
    assert len(rewards) == len(run["rollouts"]) and set(rewards) <= {0.0, 1.0}
    for rid, (task, _, reward) in run["rollouts"].items():
        assert task.input["db"] == "chinook" and reward in (0.0, 1.0)
        assert sql.reward(task.reward_input, answers[rid]) == reward  # the final query, scored again here
    for h in run["history"]:
        assert 0.0 <= h["reward_mean"] <= 1.0


def test_held_out_accuracy_is_reported_per_family(run):
    """task.balance=family: the held-out evaluation's accuracy of each family, recomputed from the store's greedy
    rollouts (no group), the last 4 being the final evaluation's."""
    final = run["history"][-1]["eval"]
    assert len(run["held_out"]) == 8  # before training and after it
    by_family: dict[str, list[bool]] = {}
    for task, _, reward in run["held_out"][-4:]:
        by_family.setdefault(task.input["family"], []).append(reward == 1.0)
    assert final["accuracy_by"] == {f: sum(right) / len(right) for f, right in sorted(by_family.items())}
    assert len(final["accuracy_by"]) == 4  # 4 held-out questions, drawn family by family
    assert final["accuracy"] == sum(right for rights in by_family.values() for right in rights) / 4
