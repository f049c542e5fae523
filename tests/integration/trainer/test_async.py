"""rollout.mode=async on the real stack (Ray, Serve with the HF engine, the SQLite store, Ray Train + DeepSpeed, the
tiny model): the next batch's rollouts run while the learner trains on this one, each transition's sampler is at most
algorithm.max_staleness versions behind the learner that trains it, and the run's records say so.

The run also stands for any run's overlong filter (algorithm.overlong_filter: answers cut at 4 tokens, where the tiny
model answers in 3-5, are recorded and left out of the loss): a run start is most of a test's time on this machine,
so one run checks what needs no run of its own."""

from __future__ import annotations

import json
import sqlite3
from collections import defaultdict

import pytest
from helpers import small

from lightning_ray.config import ConfigError, validate
from lightning_ray.models.tiny import EASY
from lightning_ray.trainer import train


@pytest.fixture(scope="module")
def run(ray_cluster, tiny_model_path, serve_port, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("async")
    cfg = small({
        "run_dir": str(run_dir), "model": {"path": str(tiny_model_path)}, "serve": {"port": serve_port},
        "trainer": {"iterations": 3, "eval_every": 0, "checkpoint_every": 3},
        "learner": {"lr": 1e-3},
        "task": {"generator": EASY, "eval_size": 4},
        # PPO: its value head gives every transition a signal, so each iteration updates and versions advance by one
        "algorithm": {"estimator": "ppo", "overlong_filter": True},
        "rollout": {"mode": "async", "tasks_per_iteration": 8, "group_size": 4, "agents_per_worker": 4,
                    "max_tokens": 4},
    })
    history = train(cfg)
    db = sqlite3.connect(run_dir / "traces.sqlite")
    enqueued, batch_of = {}, {}  # batch -> when its first rollout was queued; rollout -> its batch
    for rollout_id, task, at in db.execute("SELECT rollout_id, task, enqueued_at FROM rollouts"):
        batch_of[rollout_id] = batch = int(json.loads(task)["group_id"].rsplit("@", 1)[1])
        enqueued[batch] = min(at, enqueued.get(batch, at))
    served = {}  # policy version -> when the first call it answered started
    finished = defaultdict(list)  # batch -> its calls' finish reasons
    spans = sqlite3.connect(run_dir / "traces-spans.sqlite")
    for rollout_id, attributes, start in spans.execute(
            "SELECT rollout_id, attributes, start_time FROM spans WHERE name = 'llm.call'"):
        attributes = json.loads(attributes)
        version = attributes["lightning_ray.policy_version"]
        served[version] = min(start, served.get(version, start))
        if rollout_id:  # not a weight sync's probe
            finished[batch_of[rollout_id]].append(attributes["gen_ai.response.finish_reasons"])
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"history": history, "enqueued": enqueued, "served": served, "lines": lines, "finished": finished}


def test_each_batch_is_sampled_within_the_staleness_bound(run):
    history = run["history"]
    assert [h["iteration"] for h in history] == [0, 1, 2] and all(h["updated"] for h in history)
    assert [h["policy_version"] for h in history] == [1, 2, 3]
    for i, h in enumerate(history):
        # batch i started before update i-1 (learner at version i-1) and was trained after it (version i)
        assert set(h["rollout_policy_versions"]) <= {max(i - 1, 0), i}
        assert set(h["staleness"]) <= {0, 1} and h["stale_dropped"] == 0
        assert sum(h["staleness"].values()) == h["transitions"]
    assert history[0]["staleness"] == {0: history[0]["transitions"]}  # the first batch: collected before any update


def test_the_next_batch_runs_while_the_learner_trains(run):
    """Batch i+1's rollouts were queued before version i+1 answered its first call: during update i, not after it
    (sync mode queues them once iteration i is logged). The learner waited for those batches (phase `wait`), not
    for their whole collection."""
    for i in (0, 1):
        assert run["enqueued"][i + 1] < run["served"][i + 1]
    for h in run["history"][1:]:
        assert "wait" in h["seconds"] and h["idle_seconds"]["learner"] == pytest.approx(h["seconds"]["wait"], abs=0.05)
    assert [line["staleness"] for line in run["lines"]] == [
        {str(k): v for k, v in h["staleness"].items()} for h in run["history"]]  # metrics.jsonl has the histogram


def test_overlong_filter_leaves_cut_off_answers_out_of_training(run):
    cuts = 0
    for h in run["history"]:
        finished = run["finished"][h["iteration"]]
        cut = sum(reasons == ["length"] for reasons in finished)
        assert len(finished) == h["policy_calls"] and h["truncation_rate"] == cut / len(finished)
        assert h["transitions"] == len(finished) - cut
        cuts += cut
    assert 0 < cuts < sum(h["policy_calls"] for h in run["history"])  # some cut at 4 tokens, some not


def test_async_weighs_stale_samples_and_keeps_engines_awake():
    """Truncated importance sampling is on in async mode unless set otherwise; sleeping engines are refused. A weight
    update keeps the calls in flight going in async mode (partial rollouts), waits for them in sync mode; a call
    kept going across an update has tokens of two versions, so `keep` turns truncated importance sampling on too."""
    async_run = validate({"run_dir": "x", "rollout": {"mode": "async"}})
    assert (async_run.algorithm.tis_cap, async_run.serve.drain) == (2.0, "keep")
    assert validate({"run_dir": "x", "rollout": {"mode": "async"}, "algorithm": {"tis_cap": 5}}).algorithm.tis_cap == 5
    sync_run = validate({"run_dir": "x"})
    assert (sync_run.algorithm.tis_cap, sync_run.serve.drain) == (None, "wait")
    assert validate({"run_dir": "x", "serve": {"drain": "keep"}}).algorithm.tis_cap == 2.0
    assert validate({"run_dir": "x", "rollout": {"mode": "async"}, "serve": {"drain": "wait"}}).serve.drain == "wait"
    with pytest.raises(ConfigError, match="rollout.mode=async.*engine.sleep_while_training"):
        validate({"run_dir": "x", "rollout": {"mode": "async"}, "engine": {"sleep_while_training": True}})
