"""A CrewAI crew of two agents, unchanged, trained from its own Ray runtime_env (CrewAI's openai 2 and pydantic 2.12
cannot share the trainer's environment: the worker imports crewai, which only that environment has). Two iterations
of the whole loop with `algorithm.select.agents=[solver]`: the solver's calls are trained, the verifier's are not.

The tiny test model writes garbage: what is checked is the plumbing (calls recorded under their agents, selection,
training iterations ran). The first run installs the environment from PyPI (envs/crewai/README.md says how long)."""

from __future__ import annotations

import json
import sqlite3
from collections import Counter

import pytest
from omegaconf import OmegaConf

from lightning_ray.algorithm.select import agent_of
from lightning_ray.types import Span

from helpers import ROOT, small

ROLLOUTS_PER_ITERATION = 2 * 2


@pytest.fixture(scope="module")
def run(ray_cluster, tiny_model_path, serve_port, tmp_path_factory):
    """configs/task/calc_crewai.yaml as it is, run for two iterations with the solver selected."""
    from lightning_ray.models.tiny import EASY
    from lightning_ray.trainer import train

    run_dir = tmp_path_factory.mktemp("crewai-run")
    task = OmegaConf.to_container(OmegaConf.load(ROOT / "configs/task/calc_crewai.yaml"))
    task.pop("defaults")
    task.update(generator=EASY, eval_size=4)
    task["runtime_env"]["pip"] = str(ROOT / task["runtime_env"]["pip"])
    cfg = small({"run_dir": str(run_dir), "model": {"path": str(tiny_model_path)}, "task": task,
                 "serve": {"port": serve_port, "chat_template": "hermes"},
                 "rollout": {"tasks_per_iteration": 2, "group_size": 2, "max_tokens": 32,
                             "agents_per_worker": 2},
                 # one sample per selected call, so transitions count the solver's calls
                 "algorithm": {"select": {"agents": ["solver"]}, "level": "transition"},
                 "trainer": {"iterations": 2, "eval_every": 0},
                 "learner": {"num_workers": 1, "threads_per_worker": 1, "lr": 1e-3}})
    history = train(cfg)
    spans = [Span(span_id=r[0], trace_id=r[1], parent_id=r[2], rollout_id=r[3], attempt_id=r[4], name=r[5],
                  start_time=r[6], attributes=json.loads(r[7]), origin=r[8])
             for r in sqlite3.connect(run_dir / "traces-spans.sqlite").execute(
                 "SELECT span_id, trace_id, parent_id, rollout_id, attempt_id, name, start_time, attributes, origin "
                 "FROM spans WHERE rollout_id IS NOT NULL")]
    return {"history": history, "spans": spans}


def test_every_rollout_ran_the_crew_in_its_own_environment(run):
    assert [h["iteration"] for h in run["history"]] == [0, 1]
    for h in run["history"]:  # a worker without CrewAI's environment fails every rollout (no crewai to import)
        assert h["rollouts"] == ROLLOUTS_PER_ITERATION and h["failed_rollouts"] == h["infra_failed_rollouts"] == 0


def test_every_call_nests_under_the_agent_that_made_it(run):
    by_rollout: dict[str, list[Span]] = {}
    for s in run["spans"]:
        by_rollout.setdefault(s.rollout_id, []).append(s)
    assert len(by_rollout) == 2 * ROLLOUTS_PER_ITERATION
    for spans in by_rollout.values():
        by_id = {s.span_id: s for s in spans}
        calls = sorted((s for s in spans if s.name == "llm.call" and s.origin == "server"), key=lambda s: s.start_time)
        agents = [agent_of(c, by_id) for c in calls]
        # the sequential crew: the solver's turn (its calls until it answers), then the verifier's one call
        solver_calls = agents.count("solver")
        assert solver_calls >= 1 and agents == ["solver"] * solver_calls + ["verifier"]
        # CrewAI sent the solver its calculator tool (strict, as CrewAI writes tools) and the verifier none
        assert calls[0].attributes["lightning_ray.request"]["tools"][0]["function"]["name"] == "calculator"
        assert not calls[-1].attributes["lightning_ray.request"].get("tools")


def test_only_the_solver_calls_became_transitions(run):
    calls = [s for s in run["spans"] if s.name == "llm.call" and s.origin == "server"]
    by_id = {s.span_id: s for s in run["spans"]}
    made_by = Counter(agent_of(c, by_id) for c in calls)
    assert made_by["verifier"] == 2 * ROLLOUTS_PER_ITERATION and made_by["solver"] >= 2 * ROLLOUTS_PER_ITERATION
    history = run["history"]
    assert sum(h["llm_spans"] for h in history) == len(calls)  # every recorded call, the verifier's included ...
    # ... of which the solver's were trained: one transition each, none of the verifier's
    assert sum(h["transitions"] for h in history) == sum(h["policy_calls"] for h in history) == made_by["solver"]
