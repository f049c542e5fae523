"""The `lightning-ray` command on real runs: a short `train` on the tiny model (Ray, Serve, the HF engine, DeepSpeed,
SQLite; conftest.py's run), then `store inspect|export` and `report` on its run directory, `eval` and `serve` on its
checkpoint, `serve` answering a real openai client until Ctrl-C."""

from __future__ import annotations

import json
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import CLI, ROOT, TINY, cli, free_port, free_ports
from openai import OpenAI

from lightning_ray.tracing import semconv

def test_ports_given_to_jobs_are_ones_no_one_else_is_handed():
    """A job binds its port seconds after the test picked it: a port the kernel or Ray could hand to another socket
    meanwhile (a Ray worker's, an outgoing connection's) would make the job fail to bind, by chance."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = free_ports(50)
    assert len(set(ports)) == 50
    assert not [p for p in ports if low <= p <= high or 10_002 <= p <= 19_999]


@pytest.mark.parametrize("command", [[], ["train"], ["eval"], ["serve"], ["store"], ["store", "inspect"],
                                     ["store", "export"], ["report"]])
def test_every_command_has_help(command):
    r = cli(*command, "--help")
    assert r.returncode == 0, r.stderr
    assert f"Usage: lightning-ray {' '.join(command)}".strip() in " ".join(r.stdout.split())


@pytest.mark.parametrize("args, named", [
    (["store", "inspect", "no/such/run"], "no/such/run"),
    (["store", "export", "no/such/run"], "no/such/run"),
    (["report", "no/such/run"], "no/such/run"),
    (["store", "export", ".", "--what", "tokens"], "--what"),
    (["report", ".", "--format", "pdf"], "--format"),
    (["store", "vacuum"], "vacuum"),
])
def test_bad_input_is_one_line_and_exit_code_2(args, named):
    r = cli(*args)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and named in r.stderr and "Traceback" not in r.stderr


def test_a_run_directory_that_does_not_read_is_one_line_and_exit_code_2(tmp_path):
    """A metrics.jsonl with no line yet, or a line cut off before others: tracebacks before."""
    for text, named in [("", "no iteration written yet"), ('{"iter\n{"iteration": 0}\n', "line 1 is not JSON")]:
        (tmp_path / "metrics.jsonl").write_text(text)
        r = cli("report", str(tmp_path))
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and named in r.stderr, r.stderr


def test_report_of_a_running_job_leaves_out_the_line_being_written(tmp_path):
    """A running job's metrics.jsonl, its last line half-written: the report of the lines before (it exited 2), and
    its seconds count the evaluation before training, which is in no iteration's seconds."""
    line = {"iteration": 0, "reward_mean": 0.25, "rollouts": 8, "transitions": 8, "updated": True,
            "policy_version": 1, "seconds": {"rollout": 10.0, "train": 5.0},
            "eval_before": {"after": 0, "accuracy": 0.5, "seconds": 7.0}}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(line) + '\n{"iteration": 1, "rew')
    r = cli("report", str(tmp_path), "-o", str(tmp_path / "out"))
    assert r.returncode == 0 and "last line is not written yet" in r.stderr, r.stderr
    page = (tmp_path / "out" / "report.md").read_text()
    assert "| iterations | 1 |" in page and "| seconds | 22 |" in page, page


@pytest.mark.parametrize("override, named", [("rollout.group_size=0", "rollout.group_size"),
                                             ("trainer.lr=1e-3", "trainer.lr is now learner.lr"),  # a moved key
                                             # a dataset its task has not: said before any service starts
                                             ("task.dataset=spider", "task: dataset 'spider'"),
                                             # the form docs/02 recommends for a key, its variable unset
                                             ("serve.api_key=${oc.env:LIGHTNING_RAY_UNSET_KEY}",
                                              "serve.api_key: KeyError raised while resolving")])
def test_train_passes_config_errors_through_by_key(tmp_path, override, named):
    r = cli("train", override, f"hydra.run.dir={tmp_path}")
    assert r.returncode != 0 and named in r.stderr and "Traceback" not in r.stderr


def test_a_run_whose_every_rollout_the_platform_fails_stops_saying_why(tiny_model_path, tmp_path):
    """An agent command that cannot start (a typo): every rollout failed without a reward, and the run went on to
    its last iteration training nothing, its terminal saying reward 0.000. It stops at the first round, in a line
    that says what the attempts said. The held-out accuracy before it says its rollouts failed (a bare 0.000)."""
    r = cli("train", *TINY, "task.command=[no-such-agent-command]", f"serve.port={free_port()}",
            f"hydra.run.dir={tmp_path}", timeout=300)
    said = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert ("held-out accuracy before training: 0.000 (4 of 4 rollouts failed, most often: 4x "
            "AgentCommandFailedByPlatform: task.command ['no-such-agent-command'] could not start") in r.stdout
    assert said.startswith("every rollout of iteration 0 (32) failed on the platform's side")
    assert "32x AgentCommandFailedByPlatform: task.command ['no-such-agent-command'] could not start" in said
    assert (tmp_path / "metrics.jsonl").read_text() == ""  # no iteration logged


def test_a_serve_port_taken_or_a_model_not_there_is_refused_before_ray_starts(tmp_path):
    """Serve's proxy failed to bind a port in use half a minute into the start, and a model.path with no model
    failed after Ray's start, each in a page of traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for job, settings, said in (
                ("train", [f"serve.port={port}"], f"serve.port={port}: 127.0.0.1:{port} is taken"),
                ("serve", [f"serve.port={port}"], f"serve.port={port}: 127.0.0.1:{port} is taken"),
                ("eval", [f"model.path={tmp_path}"], f"model.path={tmp_path}: no config.json"),
                ("train", [f"model.adapter={tmp_path}", "learner.lora={}"], f"model.adapter={tmp_path}: no LoRA")):
            r = cli(job, *TINY, *settings, f"hydra.run.dir={tmp_path / job}")
            assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
            assert r.stderr.strip().splitlines()[-1].startswith(said)
            assert not list((tmp_path / job / "logs").glob("ray"))  # no cluster started


def test_train_prints_the_resolved_config_with_hydra_flags():
    r = cli("train", "trainer.iterations=3", "--cfg", "job")
    assert r.returncode == 0, r.stderr
    assert "iterations: 3" in r.stdout


def test_console_script_is_installed():
    script = Path(sys.executable).with_name("lightning-ray")
    if not script.exists():
        pytest.skip("the venv predates [project.scripts] lightning-ray: runs once `make setup` reinstalls the package")
    r = subprocess.run([script, "store", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "inspect" in r.stdout


@pytest.fixture(scope="module")
def run_dir(cli_run) -> Path:
    """conftest.py's run of `lightning-ray train`: two iterations of eight groups of four, four held-out problems."""
    return cli_run["dir"]


def sql(run: Path, query: str, spans: bool = False) -> list[tuple]:
    return sqlite3.connect(run / ("traces-spans.sqlite" if spans else "traces.sqlite")).execute(query).fetchall()


def test_train_writes_a_run_directory(run_dir, cli_run):
    metrics = cli_run["history"]
    assert [m["rollouts"] for m in metrics] == [32, 32]
    assert all(m["updated"] for m in metrics) and (run_dir / "config.yaml").exists()
    assert (run_dir / "checkpoint" / "config.json").exists(), sorted(p.name for p in run_dir.iterdir())


def test_store_inspect_summarizes_the_run(run_dir, cli_run):
    r = cli("store", "inspect", str(run_dir), "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["rollouts_by_status"] == dict(sql(run_dir, "SELECT status, COUNT(*) FROM rollouts GROUP BY status"))
    assert s["rollouts"] == 2 * 32 + 2 * 4  # training; held-out evaluation before and after
    assert s["spans"] == sql(run_dir, "SELECT COUNT(*) FROM spans", spans=True)[0][0]
    # the spans kept (store.keep_iterations=1): the last iteration's calls and the final evaluation's
    assert s["spans_by_name"][semconv.LLM_CALL] >= s["policy_calls"] >= cli_run["history"][-1]["policy_calls"] > 0
    assert s["iterations"] == 2 and 0 < s["transitions"] <= s["policy_calls"]
    rewards = [r for (r,) in sql(run_dir, "SELECT reward FROM rollouts WHERE reward IS NOT NULL")]
    assert s["rewards"]["scored"] == len(rewards) and s["rewards"]["mean"] == pytest.approx(sum(rewards) / len(rewards))
    human = cli("store", "inspect", str(run_dir))
    assert human.returncode == 0 and f"rollouts     {s['rollouts']}" in human.stdout


def test_store_export_writes_jsonl(run_dir, tmp_path):
    exported = {}
    for what in ("rollouts", "spans", "transitions"):
        out = tmp_path / f"{what}.jsonl"
        r = cli("store", "export", str(run_dir), "--what", what, "-o", str(out))
        assert r.returncode == 0, r.stderr
        exported[what] = [json.loads(line) for line in out.read_text().splitlines()]
    stored = {rollout_id for (rollout_id,) in sql(run_dir, "SELECT rollout_id FROM rollouts")}
    assert {r["rollout_id"] for r in exported["rollouts"]} == stored
    assert len(exported["spans"]) == sql(run_dir, "SELECT COUNT(*) FROM spans", spans=True)[0][0]
    calls = {s["span_id"]: s for s in exported["spans"] if s["name"] == semconv.LLM_CALL and s["origin"] == "server"}
    transitions = exported["transitions"]
    assert transitions and {t["span_id"] for t in transitions} <= set(calls)
    held_out = {r["rollout_id"] for r in exported["rollouts"] if not r["task"]["group_id"]}
    assert held_out and not held_out & {t["rollout_id"] for t in transitions}  # no held-out problem in SFT data
    for t in transitions:  # the engine's token ids, unpacked from the store's arrays as the trainer reads them
        call = calls[t["span_id"]]["attributes"]
        assert t["prompt_ids"] == call[semconv.PROMPT_TOKEN_IDS]
        assert all(isinstance(i, int) for i in t["response_ids"]) and len(t["logprobs"]) == len(t["response_ids"])
    stdout = cli("store", "export", str(run_dir), "--what", "rollouts")  # no -o: JSONL on stdout
    assert [json.loads(line)["rollout_id"] for line in stdout.stdout.splitlines()] == [
        r["rollout_id"] for r in exported["rollouts"]]


@pytest.mark.parametrize("fmt", ["md", "html"])
def test_report_writes_a_page_with_curves(run_dir, cli_run, tmp_path, fmt):
    r = cli("report", str(run_dir), "--format", fmt, "-o", str(tmp_path))
    assert r.returncode == 0, r.stderr
    page = (tmp_path / f"report.{fmt}").read_text()
    for stem in ("reward", "loss", "response_length", "heldout_accuracy"):
        assert f"{stem}.png" in page
        assert (tmp_path / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "iterations" in page and f"{cli_run['history'][-1]['eval']['accuracy']:.3f}" in page


def test_eval_measures_the_checkpoint_in_a_sweep_with_a_directory_per_job(run_dir, tmp_path, monkeypatch):
    """`lightning-ray eval -m seed=0,1` on the run's checkpoint: each job its own run directory and eval.json.
    Every job of a sweep resolves ${now:...} alike (OmegaConf caches it), so each gets run_root/multirun/<time>/i
    instead; Hydra's multirun.yaml lies there too, not in the current directory. Hydra writes it, and .hydra/ when
    asked, with the command line in clear: masked as each job starts, and a key given as ${oc.env:...} stays an
    interpolation there. (Every job sweeps through the same entry point, lightning_ray.config.job: evaluation is
    the cheapest of them.)"""
    monkeypatch.setenv("SWEEP_TEST_KEY", "sk-secret-2")
    stray = (ROOT / "multirun").exists()
    checkpoint = run_dir / "checkpoint"
    r = cli("eval", "-m", "seed=0,1", *TINY, f"model.path={checkpoint}", "serve.api_key=${oc.env:SWEEP_TEST_KEY}",
            f"serve.port={free_port()}", "+engine.env.HF_TOKEN=hf_sweepsecret0123", "hydra.output_subdir=.hydra",
            f"run_root={tmp_path}", timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    [sweep] = tmp_path.glob("multirun/*")
    for job in ("0", "1"):
        result = json.loads((sweep / job / "eval.json").read_text())
        assert result["model"] == str(checkpoint) and result["tasks"] == 4
        assert f"held-out accuracy {result['accuracy']:.3f} on 4 problems" in r.stdout
        saved = yaml.safe_load((sweep / job / "config.yaml").read_text())
        assert (saved["seed"], saved["serve"]["api_key"], saved["run_dir"]) == (int(job), "***", str(sweep / job))
        assert "+engine.env.HF_TOKEN=***" in yaml.safe_load((sweep / job / ".hydra" / "overrides.yaml").read_text())
    multirun = yaml.safe_load((sweep / "multirun.yaml").read_text())
    assert multirun["serve"]["api_key"] == "${oc.env:SWEEP_TEST_KEY}" and multirun["engine"]["env"]["HF_TOKEN"] == "***"
    assert "+engine.env.HF_TOKEN=***" in multirun["hydra"]["overrides"]["task"]
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and (b"sk-secret-2" in p.read_bytes()
                                                                    or b"hf_sweepsecret0123" in p.read_bytes())]
    assert (ROOT / "multirun").exists() == stray


def test_serve_answers_an_openai_client_until_ctrl_c(run_dir, tmp_path):
    """verbose=true besides: Ray's and Serve's logs on the terminal too, not only in the run directory (the quiet
    default: test_observability.py)."""
    port = free_port()
    server = subprocess.Popen([*CLI, "serve", *TINY, f"model.path={run_dir / 'checkpoint'}", f"serve.port={port}",
                               "verbose=true", f"hydra.run.dir={tmp_path}"], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 300
        while not any(line.startswith("serving ") for line in lines):
            line = server.stdout.readline()
            assert line and time.monotonic() < deadline, "".join(lines[-40:])
            lines.append(line)
        assert f"http://127.0.0.1:{port}/v1" in lines[-1] and "curl" in server.stdout.readline()
        assert re.search(r"\(ServeController pid=\d+\)", "".join(lines)), "".join(lines[-40:])
        assert 'Started Serve in namespace "serve"' in (tmp_path / "logs" / "driver.log").read_text()
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="EMPTY", max_retries=0)
        # ignore_eos: the trained tiny model may sample its end first (an empty answer, 2026-12-07's CI run)
        out = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "What is 3 + 4?"}],
                                             max_tokens=8, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 8 and out.choices[0].finish_reason == "length"
    finally:
        server.send_signal(signal.SIGTERM)  # a pod's stop: as Ctrl-C
        try:  # Serve drains and deletes both apps, then Ray shuts down: slow on a loaded machine
            rest, _ = server.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            server.kill()
            pytest.fail("serve did not stop within 300 s of SIGTERM:\n" + server.communicate()[0][-3000:])
    assert server.returncode == 0, rest[-3000:]
    assert "stopped" in rest and "Traceback" not in rest
    served = json.loads(cli("store", "inspect", str(tmp_path), "--json").stdout)  # the call, recorded in its store
    assert served["rollouts"] == 0 and served["spans_by_name"][semconv.LLM_CALL] == 1


def test_a_run_directory_in_use_is_refused_before_anything_is_written(tmp_path):
    """A second job given a running one's run_dir overwrote its config.yaml, then (another serve.port) would have
    shared its store and queue and emptied its metrics.jsonl; and it printed the running one's resume line."""
    import fcntl

    (tmp_path / "config.yaml").write_text("the running job's\n")
    with open(tmp_path / ".lock", "w") as held:
        held.write("pid 4242 on head\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX)
        r = cli("train", *TINY, f"hydra.run.dir={tmp_path}")
    assert r.returncode != 0 and r.stderr.count("\n") == 1, r.stderr[-3000:]
    assert f"run_dir: {tmp_path} is in use by a run still running (pid 4242 on head)" in r.stderr
    assert (tmp_path / "config.yaml").read_text() == "the running job's\n" and "resume=" not in r.stderr


def test_sigterm_stops_a_training_run_as_ctrl_c_does(tmp_path):
    """`ray job stop`, `kill`, a pod's stop send SIGTERM: ray.init's handler aborted the driver 3 s later (exit 134),
    its parts unstopped and no word of the checkpoint to go on from. Now the run stops as on Ctrl-C."""
    job = subprocess.Popen([*CLI, "train", *TINY, "trainer.iterations=20", "trainer.eval_every=0",
                            "trainer.checkpoint_every=1", f"serve.port={free_port()}", f"hydra.run.dir={tmp_path}"],
                           cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, deadline = [], time.monotonic() + 300
    try:
        while not any(line.startswith("iter 0:") for line in lines):  # logged once its checkpoint is saved
            line = job.stdout.readline()
            assert line and time.monotonic() < deadline, "".join(lines[-40:])
            lines.append(line)
        job.send_signal(signal.SIGTERM)
        rest, _ = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode not in (0, -6, 134), rest[-3000:]  # interrupted, not aborted
    assert "SIGTERM received" not in rest and "stopping" in rest, rest[-3000:]
    assert f"goes on with the same command and resume={tmp_path}" in rest, rest[-3000:]


def test_the_rayservice_application_serves_the_checkpoint(run_dir, ray_cluster, serve_port, tmp_path):
    """k8s/rayservice.yaml's Serve application, `jobs.serve:app` built from its overrides (the checkpoint, results
    and replica resources swapped for this machine's), answers a real openai client and records the call."""
    import importlib.util

    import yaml
    from ray import serve

    spec = importlib.util.spec_from_file_location("jobs_serve", ROOT / "jobs" / "serve.py")
    jobs_serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(jobs_serve)
    manifest = yaml.safe_load((ROOT / "k8s" / "rayservice.yaml").read_text())
    [application] = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"]
    assert application["import_path"] == "jobs.serve:app"
    here = {"model.path": str(run_dir / "checkpoint"), "run_root": str(tmp_path), "serve.host": "127.0.0.1",
            "serve.api_key": None, "+serve.resources.GPU": None}  # the key: the pods' Secret; on loopback, none
    overrides = [o for o in application["args"]["overrides"] if o.split("=")[0] not in here]
    overrides += [f"{k}={v}" for k, v in here.items() if v] + ["engine=hf", "engine.max_model_len=512"]
    serve.start(http_options={"host": "127.0.0.1", "port": serve_port})
    serve.run(jobs_serve.app({"overrides": overrides}), name="rayservice", route_prefix="/rayservice")
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{serve_port}/rayservice/v1", api_key="EMPTY")
        reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "What is 3 + 4?"}],
                                               max_tokens=8)
        assert reply.choices[0].message.content is not None
    finally:
        serve.delete("rayservice")
    [run] = [p for p in tmp_path.iterdir() if p.is_dir()]
    calls = sqlite3.connect(run / "traces-spans.sqlite").execute(
        "SELECT COUNT(*) FROM spans WHERE name = 'llm.call'").fetchone()[0]
    assert calls == 1
