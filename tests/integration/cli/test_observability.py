"""What an operator sees of a run: a quiet terminal (progress, one line per iteration; Ray's and Serve's logs in the
run directory, back on the terminal with verbose=true: test_cli.py's `serve`) and the run's metrics on Ray's
Prometheus endpoint, as the Grafana dashboard reads them. The main job runs as a subprocess, on its own local Ray
cluster, with the tiny model."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from helpers import ROOT, free_port
from prometheus_client.parser import text_string_to_metric_families

from lightning_ray.metrics import metrics

# the smoke preset (tiny model, HF engine, the sums it was warmed up on: groups with a signal, updates), a bigger batch
SMALL_RUN = ["experiment=calc_tiny", "ray.num_cpus=2", "rollout.tasks_per_iteration=8", "rollout.agents_per_worker=4"]
RAY_LOG_LINE = re.compile(r"\bINFO\b|\((ServeController|ProxyActor|ServeReplica|TrainController|RayTrainWorker|"
                          r"raylet)\b")


def run_job(run_dir: Path, *overrides: str, while_running=lambda: None) -> str:
    """Run jobs/train.py to its end, calling `while_running` about every second; return its terminal output."""
    terminal = run_dir.parent / f"{run_dir.name}.terminal.txt"
    env = {**os.environ, "RAY_metrics_report_interval_ms": "1000"}  # Ray's default exports every 10 s
    with open(terminal, "w") as out:
        job = subprocess.Popen([sys.executable, "jobs/train.py", *SMALL_RUN, *overrides, f"hydra.run.dir={run_dir}"],
                               cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 600
        while job.poll() is None and time.monotonic() < deadline:
            while_running()
            time.sleep(1.0)
        if job.poll() is None:
            job.kill()
    output = terminal.read_text()
    assert job.returncode == 0, output[-3000:]
    return output


class Scraper:
    """Reads the job's metrics from Ray's Prometheus endpoint while it runs: the last value of every sample seen
    (series of processes that have ended drop out of later scrapes). Once the store's HTTP API is up, it posts one
    undecodable OTLP payload, an error the store counts by kind."""

    def __init__(self, metrics_port: int, serve_port: int):
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.otlp_url = f"http://127.0.0.1:{serve_port}/store/v1/traces"
        self.samples: dict[tuple, float] = {}
        self.bad_otlp_sent = False

    def __call__(self) -> None:
        try:
            if not self.bad_otlp_sent:
                r = httpx.post(self.otlp_url, content=b"not protobuf",
                               headers={"content-type": "application/x-protobuf"}, timeout=5)
                self.bad_otlp_sent = r.status_code == 400
            text = httpx.get(self.metrics_url, timeout=5).text
        except httpx.HTTPError:  # not up yet
            return
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.startswith("ray_lightning_ray_"):
                    self.samples[(s.name, tuple(sorted(s.labels.items())))] = s.value

    def values(self, name: str, **labels) -> list[float]:
        return [v for (n, ls), v in self.samples.items() if n == name and labels.items() <= dict(ls).items()]


@pytest.fixture(scope="module")
def quiet_run(tiny_model_path, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("quiet") / "run"
    metrics_port, serve_port = free_port(), free_port()
    scraper = Scraper(metrics_port, serve_port)
    # PPO: its value head gives every transition a signal, so each iteration updates and syncs, for sure (a group
    # baseline's iteration can have no signal, and then publishes nothing)
    # store.keep_iterations=1: after the second iteration, the spans of the first (and of the evaluation before it)
    # are deleted
    output = run_job(run_dir, "algorithm=ppo", "trainer.iterations=2", "trainer.eval_every=2", "store.keep_iterations=1",
                     f"serve.port={serve_port}", f"ray.metrics_export_port={metrics_port}", while_running=scraper)
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"output": output, "dir": run_dir, "history": history, "metrics": scraper}


def test_the_terminal_shows_progress_and_a_line_per_iteration(quiet_run):
    lines = quiet_run["output"].splitlines()
    assert not [line for line in lines if RAY_LOG_LINE.search(line)], quiet_run["output"]
    assert not [line for line in lines if "Warning" in line or "WARNING" in line], quiet_run["output"]
    summaries = [line for line in lines if re.match(r"iter \d+: reward", line)]
    assert [s.split(":")[0] for s in summaries] == ["iter 0", "iter 1"]
    assert f"reward {quiet_run['history'][1]['reward_mean']:.3f}" in summaries[1]
    assert "held-out accuracy before training" in quiet_run["output"]
    print(f"\nterminal lines of a 2-iteration run: {len(lines)}")


def test_only_the_kept_iterations_spans_stay(quiet_run):
    """Every rollout stays in the store; the spans of those enqueued before the last iteration are gone."""
    run_dir, [first, last] = quiet_run["dir"], quiet_run["history"]
    groups = {r: json.loads(t)["group_id"] for r, t in sqlite3.connect(run_dir / "traces.sqlite").execute(
        "SELECT rollout_id, task FROM rollouts")}
    with_spans = {r for (r,) in sqlite3.connect(run_dir / "traces-spans.sqlite").execute(
        "SELECT DISTINCT rollout_id FROM spans WHERE rollout_id IS NOT NULL")}
    iterations = {r: int(g.rsplit("@", 1)[1]) for r, g in groups.items() if g}  # evaluations' rollouts: no group
    assert sum(i == 0 for i in iterations.values()) == first["rollouts"] and not with_spans & {
        r for r, i in iterations.items() if i == 0}
    assert {r for r, i in iterations.items() if i == 1} <= with_spans and last["llm_spans"] > 0
    assert len(with_spans - set(iterations)) == 8  # the final evaluation's, in the last iteration; not the first's


def test_ray_and_serve_logs_land_in_the_run_directory(quiet_run):
    logs = quiet_run["dir"] / "logs"
    driver = (logs / "driver.log").read_text()
    assert "Started a local Ray instance" in driver and "Application 'policy' is ready" in driver
    session_logs = logs / "ray"  # the Ray session's files: every worker's output, Serve's controller and replicas
    assert session_logs.is_dir() and list(session_logs.glob("serve/controller_*.log"))


def test_the_run_is_on_the_prometheus_endpoint(quiet_run):
    m, history = quiet_run["metrics"], quiet_run["history"]
    first = history[0]  # reported before the run went on to its second iteration, so scraped for sure

    assert sum(m.values("ray_lightning_ray_rollouts_total")) >= first["rollouts"]
    assert m.values("ray_lightning_ray_queue_depth")
    rewards, accuracies = m.values("ray_lightning_ray_reward_mean"), m.values("ray_lightning_ray_held_out_accuracy")
    assert rewards and all(r in [pytest.approx(h["reward_mean"]) for h in history] for r in rewards)
    evals = [e["accuracy"] for h in history for k, e in h.items() if k in ("eval_before", "eval")]
    assert accuracies and all(a in [pytest.approx(e) for e in evals] for a in accuracies)
    assert max(m.values("ray_lightning_ray_transitions_total")) >= first["transitions"]
    policy_tokens = round(first["action_tokens_mean"] * first["rollouts"])  # iteration 0's, evaluation's besides
    assert max(m.values("ray_lightning_ray_generated_tokens_total")) >= policy_tokens > 0
    assert max(m.values("ray_lightning_ray_store_spans_total")) >= first["llm_spans"]
    assert max(m.values("ray_lightning_ray_policy_version", role="trained")) in {h["policy_version"] for h in history}
    assert m.values("ray_lightning_ray_errors_total", component="store", kind="otlp_malformed") == [1.0]
    assert first["updated"]  # PPO (see quiet_run): every iteration updates, syncs and serves a new version
    assert m.values("ray_lightning_ray_weight_sync_seconds_count")[0] >= 1
    assert max(m.values("ray_lightning_ray_policy_version", role="served")) >= 1
    assert m.values("ray_lightning_ray_staleness") == [0.0]  # on-policy: data from the version being trained


def test_the_grafana_dashboard_has_a_panel_per_metric():
    dashboard = json.loads((ROOT / "grafana" / "lightning_ray.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    named = {name for e in exprs for name in re.findall(r"ray_(lightning_ray_\w+?)(?:_total|_bucket)?\b", e)}
    defined = {metric.info["name"] for metric in vars(metrics()).values()}
    assert named == defined
    assert all(re.findall(r"ray_lightning_ray_\w+", e) for e in exprs)  # every panel reads one of ours
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"]) == len(defined)
