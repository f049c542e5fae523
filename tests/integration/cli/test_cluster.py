"""The main job submitted with `ray job submit --working-dir .` to a three-node cluster started with `ray start` on
this machine, as a user would: token auth on, the cluster's python the project's venv (nothing installed for the
job), custom resources standing in for GPUs. Its results land in run_root, outside Ray's temporary copy of the
working directory, and each component runs where config and placement put it."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import ROOT, free_ports, kill_session

RAY = str(Path(sys.executable).with_name("ray"))
HEAD = "node:__internal_head__"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head (2 CPUs) and two nodes: one with a `policy_gpu`, one with a `trainer_gpu` (1 CPU each). Each node is a
    `ray start --block` process in a process group of its own, so killing the group stops that node's processes and
    no other cluster's on the machine (`ray stop` would stop them all). Everything gets its own port; the token is
    the cluster's own."""
    tmp = tmp_path_factory.mktemp("cluster")
    (tmp / "token").write_text(secrets.token_hex(32))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}  # the job brings its code
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(tmp / "token"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}")  # `python` in a job: the venv's
    gcs, dashboard, client, *agents = free_ports(6)
    # A temporary directory per node, as on machines of their own: each node's runtime-env agent unpacks the job's
    # working directory afresh (it overwrites), and in one directory shared by all three it deleted the files under
    # the running driver (a module it imported late was not found). Short: Ray's socket paths must fit in 107 bytes.
    ray_tmp = Path(tempfile.mkdtemp(prefix="lr-", dir="/tmp"))
    common = ["--block", "--disable-usage-stats"]
    nodes = [
        ["--head", f"--port={gcs}", f"--dashboard-port={dashboard}", "--dashboard-host=127.0.0.1",
         f"--ray-client-server-port={client}", "--num-cpus=2", f"--dashboard-agent-listen-port={agents[0]}"],
        [f"--address=127.0.0.1:{gcs}", "--num-cpus=1", '--resources={"policy_gpu": 1}',
         f"--dashboard-agent-listen-port={agents[1]}"],
        [f"--address=127.0.0.1:{gcs}", "--num-cpus=1", '--resources={"trainer_gpu": 1}',
         f"--dashboard-agent-listen-port={agents[2]}"],
    ]
    procs = []
    try:
        for i, args in enumerate(nodes):  # one at a time: a node that is not up in 30 s gives up
            log = tmp / f"node-{i}.log"  # `ray start`'s own output; Ray's logs are in its temp dir
            with open(log, "w") as out:
                procs.append(subprocess.Popen([RAY, "start", *common, f"--temp-dir={ray_tmp / str(i)}", *args],
                                              env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))

            def up(p=procs[-1], n=i + 1, log=log) -> bool:
                if p.poll() is not None:
                    raise RuntimeError(f"ray start failed:\n{log.read_text()[-3000:]}")
                return len(alive_nodes(env, dashboard)) == n
            wait_for(up, f"node {i}")
        yield {"env": env, "address": f"http://127.0.0.1:{dashboard}", "dashboard": dashboard, "tmp": tmp,
               "ray_tmp": ray_tmp}
    finally:
        # each node's processes SIGKILLed (its session): nothing of the cluster outlives the tests, and terminating
        # the nodes took ~30 s of the suite
        for p in procs:
            kill_session(p)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def wait_for(ready, what: str, timeout: float = 300.0) -> None:
    deadline = time.time() + timeout
    while not ready():
        if time.time() > deadline:
            raise TimeoutError(f"{what} did not come up in {timeout}s")
        time.sleep(2)


def ray_cli(env: dict, dashboard: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([RAY, *args, f"--address=http://127.0.0.1:{dashboard}"], env=env, capture_output=True,
                          text=True, timeout=120)


def state(env: dict, dashboard: int, kind: str) -> list[dict]:
    r = ray_cli(env, dashboard, "list", kind, "--detail", "--format=json", "--limit=10000")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def alive_nodes(env: dict, dashboard: int) -> list[dict]:
    try:
        return [n for n in state(env, dashboard, "nodes") if n["state"] == "ALIVE"]
    except (AssertionError, ValueError):  # not up yet
        return []


@pytest.fixture(scope="module")
def job(cluster, tiny_model_path, tmp_path_factory):
    run_root = tmp_path_factory.mktemp("results")
    port, = free_ports(1)
    overrides = [
        "cluster=auto", f"run_root={run_root}", f"model.path={tiny_model_path}", "engine=hf",
        f"serve.port={port}", "trainer.iterations=1", "trainer.eval_every=0",
        # sums and differences of two small numbers, which the tiny model was warmed up on, at temperature 1: groups
        # whose rewards differ, so the iteration trains and its checkpoint is written (by the trainer's node)
        "task.generator.max_terms=2", "+task.generator.operators=[+,-]", "+task.generator.allow_parentheses=false",
        "+task.generator.allow_negation=false", "rollout.temperature=1.0", "rollout.tasks_per_iteration=8",
        "rollout.group_size=4", "rollout.num_workers=1", "rollout.agents_per_worker=8",
        # the replicas need the node with the policy's "GPU", the trainer's workers the node with the trainer's
        "+serve.resources.policy_gpu=1", "+learner.resources_per_worker.trainer_gpu=1",
    ]
    started = time.time()
    r = subprocess.run([RAY, "job", "submit", f"--address={cluster['address']}", "--working-dir", ".",
                        "--", "python", "jobs/train.py", *overrides],
                       cwd=ROOT, env=cluster["env"], capture_output=True, text=True, timeout=1200)
    print(f"job: {time.time() - started:.0f} s")
    return {"result": r, "run_root": run_root, **cluster}


def why_it_failed(job) -> str:
    """The job's first traceback and its end, and the nodes' own lines about processes that died (a worker killed
    for memory, a crash): what CI's log needs to tell a failure of ours from the machine's."""
    out = job["result"].stdout + job["result"].stderr
    first = out.find("Traceback")
    died = [f"{log.name}: {line}" for log in sorted(job["ray_tmp"].glob("*/session_*/logs/raylet*.out"))
            for line in log.read_text(errors="replace").splitlines()
            if any(word in line for word in ("SIGSEGV", "SIGKILL", "OOM", "memory monitor", "Check failed",
                                             "exited unexpectedly", "died"))]
    return "\n".join([out[first:first + 3000] if first >= 0 else "", "...", out[-3000:], *died[-30:]])


def test_a_submitted_job_succeeds_and_leaves_its_results_in_run_root(job):
    r = job["result"]
    assert r.returncode == 0 and "succeeded" in r.stdout, why_it_failed(job)
    [run] = list(job["run_root"].iterdir())
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [0] and metrics[0]["rollouts"] == 32 and metrics[0]["updated"]
    assert (run / "checkpoint" / "config.json").exists() and (run / "traces.sqlite").exists()
    assert f"run directory: {run}" in r.stdout  # the job says where its results are
    assert "working_dir_files" not in str(run)


def test_each_component_runs_on_the_node_with_its_resources(job):
    assert job["result"].returncode == 0, "the job failed: see the test above"
    nodes = {n["node_id"]: n["resources_total"] for n in state(job["env"], job["dashboard"], "nodes")}
    actors = state(job["env"], job["dashboard"], "actors")

    def resources_of(class_name: str) -> list[dict]:
        found = [nodes[a["node_id"]] for a in actors if a["class_name"] == class_name]
        assert found, f"no {class_name} actor"
        return found

    assert all(HEAD in r for r in resources_of("TraceStore"))  # beside the driver and its run directory
    assert all(HEAD in r for r in resources_of("Mailboxes"))  # the learner's inboxes and outbox, the driver's
    assert all(HEAD in r for r in resources_of("WeightRegistry"))  # its versions outlive any worker node
    assert all("policy_gpu" in r for r in resources_of("ServeReplica:policy:PolicyServer"))
    assert all("trainer_gpu" in r for r in resources_of("RayTrainWorker"))
    # what Ray Train would start per run for nothing here (learner/driver.py LeanTorchTrainer)
    assert not {a["class_name"] for a in actors} & {"DatasetManager", "PlacementGroupCleaner", "_QueueActor"}
    [worker] = [a for a in actors if a["class_name"] == "RayTrainWorker"]
    assert worker["placement_group_id"]  # Ray Train reserved its workers as a placement group


def test_token_auth_is_on_and_a_client_without_the_token_is_refused(job):
    """`ray start` turns token auth on whenever a token exists; clients send it only with RAY_AUTH_MODE=token."""
    env = {k: v for k, v in job["env"].items() if k != "RAY_AUTH_MODE"}
    r = ray_cli(env, job["dashboard"], "job", "list")
    assert r.returncode != 0 and ("401" in r.stdout + r.stderr or "uthenticat" in r.stdout + r.stderr)
    assert ray_cli(job["env"], job["dashboard"], "job", "list").returncode == 0
