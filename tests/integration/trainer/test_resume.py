"""Checkpoints a run goes on from: written whole or not at all, the last few kept; and a job SIGKILLed in the middle
of an iteration resumed by the same command (`resume=auto`), as a retried job would be, to the same versions and
sample counts."""

from __future__ import annotations

import json
import os
import random
import re
import sqlite3
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import CLI, ROOT, TINY, board_scalars, cli, free_port, kill_session

from lightning_ray.cli.train import resume_hint
from lightning_ray.config import ConfigError, compose
from lightning_ray.learner.checkpoint import LoopState, commit, latest, resume_point, staging
from lightning_ray.trainer.collect import draw
from lightning_ray.trainer.run import Run
from lightning_ray.trainer.schedule import Batches

# its jobs run the tiny model (TINY): built first, so the file runs once it is (tests/conftest.py orders the files)
pytestmark = pytest.mark.usefixtures("tiny_model_path")


def state(next_iteration: int) -> LoopState:
    return LoopState(next_iteration=next_iteration, policy_version=next_iteration, rng_state=[3, [1, 2], None],
                     evals=[], started=[float(i) for i in range(next_iteration)], history=[{"iteration": 0}])


def test_a_checkpoint_is_whole_or_absent_and_the_last_ones_stay(tmp_path):
    (tmp_path / "checkpoint").mkdir()  # a run directory from before checkpoints/: its policy where the link goes
    for i in (1, 2, 3):
        staged = staging(tmp_path, i)
        (staged / "policy").mkdir()
        (staged / "policy" / "config.json").write_text(json.dumps({"i": i}))
        commit(staged, state(i), keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["iter-000002", "iter-000003"]
    assert json.loads((tmp_path / "checkpoint" / "config.json").read_text()) == {"i": 3}
    assert os.readlink(tmp_path / "checkpoint") == "checkpoints/iter-000003/policy"  # relative: the directory moves
    torn = staging(tmp_path, 4)  # a save killed half-way: no state.json, not renamed
    (torn / "policy").mkdir()
    found = latest(tmp_path)
    assert found.path.name == "iter-000003" and found.state == state(3)
    assert staging(tmp_path, 4) == torn and not any(torn.iterdir())  # the next save starts it afresh
    (torn / "policy").mkdir()  # and one of another iteration (a resumed run's other schedule) goes with the next save
    commit(staging(tmp_path, 5), state(5), keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["iter-000003", "iter-000005"]
    assert latest(tmp_path / "nowhere") is None


def test_the_task_samplers_state_survives_the_checkpoint(tmp_path):
    """A resumed run draws the tasks the stopped one would have drawn next."""
    rng = random.Random(7)
    rng.sample(range(1000), 16)
    staged = staging(tmp_path, 1)
    commit(staged, LoopState(**{**state(1).model_dump(), "rng_state": rng.getstate()}), keep=1)
    resumed = random.Random()
    resumed.setstate(latest(tmp_path).state.random_state())  # through state.json
    assert resumed.sample(range(1000), 16) == rng.sample(range(1000), 16)


def test_an_async_runs_checkpoint_keeps_the_sampler_as_before_the_batches_drawn_ahead(tmp_path):
    """rollout.mode=async draws the next batches' tasks while an iteration trains; the checkpoint after it keeps the
    sampler as it stood before them, so the resumed run draws (and collects anew) the tasks the stopped one drew
    next, none skipped. (The services are a stand-in: the loop state reads only the learner's version.)"""
    cfg = compose([f"run_dir={tmp_path}", "rollout.mode=async", "algorithm.max_staleness=2", "trainer.iterations=4",
                   "trainer.tensorboard=false"])
    services = SimpleNamespace(learner=SimpleNamespace(version=1))
    run = Run(cfg, services, None)
    with Batches(run) as batches:
        batches._begin(0)
        drawn_ahead = [batches._begin(1), batches._begin(2)]
    commit(staging(tmp_path, 1), run.state(0), keep=1)
    resumed = Run(cfg, services, latest(tmp_path))
    assert resumed.first == 1 and [draw(resumed), draw(resumed)] == drawn_ahead
    with Batches(resumed) as batches:  # the states a checkpoint may still read, not one per iteration (24 kB each)
        for i in range(1, 40):
            batches._begin(i)
    assert sorted(resumed.sampler_before) == [37, 38, 39]


def test_a_stopped_run_says_how_to_go_on_and_why_it_stopped(tmp_path):
    assert resume_hint(tmp_path, RuntimeError("boom")) is None  # no checkpoint: nothing to go on from
    commit(staging(tmp_path, 3), state(3), keep=1)
    stopped = RuntimeError("the training run stopped")  # as the learner's driver raises it after Ray's OOM kill
    stopped.__cause__ = RuntimeError("Training failed: 7 worker(s) were killed due to the node running low on memory.")
    hint = resume_hint(tmp_path, stopped)
    assert "ran out of memory" in hint and "after 3 iterations" in hint and f"resume={tmp_path}" in hint
    assert "memory" not in resume_hint(tmp_path, KeyboardInterrupt())


def test_resume_auto_goes_on_where_a_checkpoint_is_and_starts_anew_where_none_is(tmp_path, capsys):
    """What a job retried after its driver died (KubeRay's backoffLimit) finds: resume=auto, a run_dir of its own."""
    def point(*overrides):
        return resume_point(compose([f"run_dir={tmp_path}", "trainer.iterations=3", *overrides]))

    assert point("resume=auto") is None and "no checkpoint" in capsys.readouterr().out  # the first attempt
    with pytest.raises(ConfigError, match="no checkpoint"):
        point(f"resume={tmp_path}")
    commit(staging(tmp_path, 2), state(2), keep=1)
    assert point("resume=auto").state.next_iteration == 2
    assert compose([f"run_dir={tmp_path / 'x'}", f"resume={tmp_path}"]).run_path == tmp_path  # resume= is run_dir
    commit(staging(tmp_path, 3), state(3), keep=1)  # all of trainer.iterations trained: done, not failed
    with pytest.raises(SystemExit) as done:
        point("resume=auto")
    assert done.value.code == 0 and "nothing left to train" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="nothing left to train"):
        point(f"resume={tmp_path}")
    assert "same command and resume=" not in resume_hint(tmp_path, KeyboardInterrupt(), auto=True)


def test_a_new_run_in_a_run_dir_holding_checkpoints_is_refused(tmp_path):
    """It pruned the other run's checkpoints by name (its own iteration 4 deleted as older than the other's 8, the
    `checkpoint` link left dangling) and appended to its records."""
    commit(staging(tmp_path, 8), state(8), keep=2)
    with pytest.raises(ConfigError, match=re.escape(f"run_dir={tmp_path} holds a run's checkpoints")):
        resume_point(compose([f"run_dir={tmp_path}", "trainer.iterations=10"]))
    assert resume_point(compose([f"run_dir={tmp_path / 'another'}"])) is None


def test_a_retried_job_whose_run_had_finished_succeeds_at_once(tmp_path):
    commit(staging(tmp_path, 1), state(1), keep=1)  # TINY trains one iteration
    r = cli("train", *TINY, f"run_dir={tmp_path}", "resume=auto", timeout=120)
    assert r.returncode == 0 and "nothing left to train" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert (tmp_path / "train.log").exists()  # run_dir= is Hydra's run directory too: no other made for its log


def test_resume_names_what_is_missing(tmp_path):
    r = cli("train", *TINY, f"resume={tmp_path}", timeout=120)
    assert r.returncode != 0 and f"resume={tmp_path}: no checkpoint" in r.stderr + r.stdout


def test_a_run_killed_mid_iteration_goes_on_from_its_checkpoint(tmp_path):
    """Two iterations, a checkpoint after each. The job is SIGKILLed (the driver and the local Ray cluster it
    started) once iteration 1's rollouts are running; the same command (`resume=auto`, a run_dir of its own: a
    new run the first time) runs iteration 1 again, once: each iteration is in metrics.jsonl once, with a full
    batch, sampled by the version the one before it published; the killed iteration's unfinished rollouts are
    cancelled, not trained."""
    run = tmp_path / "run"
    args = [*TINY, "trainer.iterations=2", "trainer.checkpoint_every=1", "trainer.eval_every=0",
            f"serve.port={free_port()}", f"hydra.run.dir={run}", "resume=auto"]
    run.mkdir()  # as an attempt that died before its first checkpoint left it: the new run's lines replace it
    (run / "metrics.jsonl").write_text(json.dumps({"iteration": 0, "stale": True}) + "\n")
    job = subprocess.Popen([*CLI, "train", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)  # its own session: Ray's processes too
    try:
        deadline = time.monotonic() + 600
        # iteration 1 has begun (its checkpoint before it is whole) and some of its rollouts are unfinished: a tight
        # poll, as the tiny model's 32 rollouts can all end within a second
        while not unfinished(run):
            assert job.poll() is None, job.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "iteration 1 never started"
            time.sleep(0.02)
    finally:
        kill_session(job)  # the driver and every process of its Ray cluster
    left = unfinished(run)  # what the killed run left: none of its processes writes any more
    assert left and latest(run).state.next_iteration == 1
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [h["iteration"] for h in logged] == [0] and "stale" not in logged[0]  # the new run's lines alone
    r = cli("train", *args, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "resumed from iter-000001: iteration 1, policy v1" in r.stdout
    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [h["iteration"] for h in history] == [0, 1]
    assert [h["rollouts"] for h in history] == [32] * 2
    assert board_scalars(run / "tensorboard")["reward_mean"] == pytest.approx(  # TensorBoard shows each once too
        {h["iteration"] + 1: h["reward_mean"] for h in history}, rel=1e-6)
    versions = [0] + [h["policy_version"] for h in history]
    for before, h in zip(versions, history):
        assert h["rollout_policy_versions"] == [before]  # sampled by the version the iteration before published
    assert latest(run).state.next_iteration == 2 and latest(run).state.policy_version == versions[-1]
    again = [status for status, iteration in rollout_rows(run) if iteration == 1]
    killed = [status for status in again if status != "succeeded"]
    assert len(killed) == len(left) and set(killed) <= {"cancelled", "failed"}  # the killed run's unfinished
    assert again.count("succeeded") >= 32 and len(again) <= 64  # the resumed run's batch, the killed one's part


def rollout_rows(run: Path) -> list[tuple[str, int]]:
    """(status, iteration) of every rollout in the run's store (the iteration from its group id, task@iteration)."""
    if not (run / "traces.sqlite").exists():
        return []
    try:
        rows = sqlite3.connect(run / "traces.sqlite", timeout=5).execute("SELECT status, task FROM rollouts").fetchall()
    except sqlite3.OperationalError:  # the store has not made its tables yet
        return []
    return [(status, int(json.loads(task)["group_id"].rsplit("@", 1)[1])) for status, task in rows
            if json.loads(task).get("group_id")]


def unfinished(run: Path, iteration: int = 1) -> list[str]:
    return [status for status, i in rollout_rows(run) if i == iteration and status in ("queued", "requeued", "running")]
