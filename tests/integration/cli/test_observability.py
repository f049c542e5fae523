"""What an operator sees of a run: a quiet terminal (progress, one line per iteration; Ray's and Serve's logs in the
run directory, back on the terminal with verbose=true: test_cli.py's `serve`) and the run's metrics on Ray's
Prometheus endpoint, as the Grafana dashboard reads them. The run is conftest.py's: `lightning-ray train` as a
subprocess, on its own local Ray cluster, with the tiny model."""

from __future__ import annotations

import json
import re
import sqlite3

import pytest
from helpers import ROOT

from lightning_ray.metrics import metrics

RAY_LOG_LINE = re.compile(r"\bINFO\b|\((ServeController|ProxyActor|ServeReplica|TrainController|RayTrainWorker|"
                          r"raylet)\b")


def test_the_terminal_shows_progress_and_a_line_per_iteration(cli_run):
    lines = cli_run["output"].splitlines()
    assert not [line for line in lines if RAY_LOG_LINE.search(line)], cli_run["output"]
    assert not [line for line in lines if "Warning" in line or "WARNING" in line], cli_run["output"]
    summaries = [line for line in lines if re.match(r"iter \d+: reward", line)]
    assert [s.split(":")[0] for s in summaries] == ["iter 0", "iter 1"]
    assert f"reward {cli_run['history'][1]['reward_mean']:.3f}" in summaries[1]
    assert "held-out accuracy before training" in cli_run["output"]
    # where the start's time went, part by part, adding up to the whole
    [(total, parts)] = re.findall(r"^started in ([\d.]+) s \((.*)\)$", cli_run["output"], re.M)
    seconds = dict(re.findall(r"(\S[^,]*?) ([\d.]+)(?:, |$)", parts))
    assert list(seconds) == ["Ray", "the model", "the trace store", "the weight registry", "the learner",
                             "the rollout workers", "the policy server (hf engine) and the rollout workers",
                             "the learner's ranks (Ray Train with DeepSpeed)"], parts
    # each printed to 0.1 s
    assert sum(map(float, seconds.values())) == pytest.approx(float(total), abs=0.06 * (len(seconds) + 1))
    print(f"\nterminal lines of a 2-iteration run: {len(lines)}")


def test_only_the_kept_iterations_spans_stay(cli_run):
    """Every rollout stays in the store; the spans of those enqueued before the last iteration are gone."""
    run_dir, [first, last] = cli_run["dir"], cli_run["history"]
    groups = {r: json.loads(t)["group_id"] for r, t in sqlite3.connect(run_dir / "traces.sqlite").execute(
        "SELECT rollout_id, task FROM rollouts")}
    with_spans = {r for (r,) in sqlite3.connect(run_dir / "traces-spans.sqlite").execute(
        "SELECT DISTINCT rollout_id FROM spans WHERE rollout_id IS NOT NULL")}
    iterations = {r: int(g.rsplit("@", 1)[1]) for r, g in groups.items() if g}  # evaluations' rollouts: no group
    assert sum(i == 0 for i in iterations.values()) == first["rollouts"] and not with_spans & {
        r for r, i in iterations.items() if i == 0}
    assert {r for r, i in iterations.items() if i == 1} <= with_spans and last["llm_spans"] > 0
    # the final evaluation's, in the last iteration; not the first's
    assert len(with_spans - set(iterations)) == last["eval"]["tasks"]


def test_ray_and_serve_logs_land_in_the_run_directory(cli_run):
    logs = cli_run["dir"] / "logs"
    driver = (logs / "driver.log").read_text()
    assert "Started a local Ray instance" in driver and 'Started Serve in namespace "serve"' in driver
    session_logs = logs / "ray"  # the Ray session's files: every worker's output, Serve's controller and replicas
    assert session_logs.is_dir() and list(session_logs.glob("serve/controller_*.log"))


def test_the_run_is_on_the_prometheus_endpoint(cli_run):
    m, history = cli_run["metrics"], cli_run["history"]
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
    assert first["updated"]  # PPO (see cli_run): every iteration updates, syncs and serves a new version
    assert m.values("ray_lightning_ray_weight_sync_seconds_count")[0] >= 1
    assert max(m.values("ray_lightning_ray_policy_version", role="served")) >= 1
    assert m.values("ray_lightning_ray_staleness") == [0.0]  # on-policy: data from the version being trained
    # the driver's gauges by run (a sweep's jobs share a cluster): its directory's name
    assert m.values("ray_lightning_ray_reward_mean", run=cli_run["dir"].name) == rewards


def test_the_grafana_dashboard_has_a_panel_per_metric():
    dashboard = json.loads((ROOT / "grafana" / "lightning_ray.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    named = {name for e in exprs for name in re.findall(r"ray_(lightning_ray_\w+?)(?:_total|_bucket)?\b", e)}
    defined = {metric.info["name"] for metric in vars(metrics()).values()}
    assert named == defined
    assert all(re.findall(r"ray_lightning_ray_\w+", e) for e in exprs)  # every panel reads one of ours
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"]) == len(defined)
