"""A soak with faults: the training job on a three-node local cluster for --minutes while a chaos thread SIGKILLs, at
random intervals, a rollout worker, a policy replica, the trace store's actor, a learner rank or a whole worker node
(a replacement then joins, as an autoscaler would start one); then what must hold, counted from the run's store and
record: every fault recovered, the run went on to its end, no rollout was lost (each one it queued ended), each call
was read into training at most once (the calls the iterations read are exactly the LLM spans of the training
rollouts' final attempts), and every replica serves the final version.

    python benchmarks/soak.py [--minutes 20] [--mean-gap 40] [--seed 0] [key=value ...]   # Hydra overrides

The cluster: a head with 2 CPUs (`ray.cluster_utils.Cluster`: the driver and the store on it) and two nodes joined
with `ray start`, each in a session of its own, one holding the policy's two replicas (`policy_gpu`), one the
learner's rank (`trainer_gpu`), as tests/integration/cli/test_cluster.py places them. The job is the calc agent on
the tiny test model (HF engine). Not part of CI (`make soak`). Prints a JSON line per fault once it recovered, then
the summary; writes soak.json in runs/soak-<time>/.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster
from ray.util.state import list_actors

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import kill_session  # noqa: E402  (a node's crash: every process of its session)

from lightning_ray.config import ModelConfig, compose
from lightning_ray.models import resolve_model_path
from lightning_ray.tracing.semconv import LLM_CALL
from lightning_ray.trainer import train

# what the chaos thread kills: Ray's actor class name, by what it is in the run
TARGETS = {"rollout worker": "RolloutWorker", "policy replica": "ServeReplica:policy", "trace store": "TraceStore",
           "learner rank": "RayTrainWorker"}
# the worker nodes, by their custom resources (the head, with the driver and the store, stays)
NODES = {"policy node": {"num_cpus": 2, "resources": {"policy_gpu": 2}},
         "trainer node": {"num_cpus": 1, "resources": {"trainer_gpu": 1}}}
# what brings each fault back, as the report says it (the mechanisms the checks then verify)
RECOVERED_BY = {
    "rollout worker": "Ray restarts the actor (max_restarts=-1); its leased attempts run out (rollout."
                      "unresponsive_seconds) and are retried (rollout.max_attempts)",
    "policy replica": "Serve starts a new replica, which loads the registry's latest version before it is routed to; "
                      "the calls it was answering end in a server error, the platform's failure, and are retried",
    "trace store": "Ray restarts the actor on the head from its SQLite files; Ray retries the calls it was sent "
                   "(max_task_retries=-1)",
    "learner rank": "Ray Train restarts every rank (learner.max_restarts); they load the latest checkpoint, rank 0 "
                    "republishes its weights as the next version, the command in flight is sent again",
    "policy node": "a node joins in its place; Serve starts the replicas there (each on the latest version), as for a "
                   "replica, and the rollout workers it held restart, as for a rollout worker",
    "trainer node": "a node joins in its place; Ray Train starts the ranks there, as for a learner rank",
}
FINAL = ("succeeded", "failed", "cancelled")
RAY = str(Path(sys.executable).with_name("ray"))


def start_node(address: str, node: dict) -> subprocess.Popen:
    """A worker node, `ray start --block` in a session of its own; returns once the cluster counts it."""
    count = len([n for n in ray.nodes() if n["Alive"]])
    proc = subprocess.Popen([RAY, "start", f"--address={address}", "--block", "--disable-usage-stats",
                             f"--num-cpus={node['num_cpus']}", f"--resources={json.dumps(node['resources'])}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    while len([n for n in ray.nodes() if n["Alive"]]) <= count:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}")
        time.sleep(0.5)
    return proc


def on(node: subprocess.Popen, pid: int) -> bool:
    """Whether process `pid` runs on this node (in its `ray start` session)."""
    try:
        return os.getsid(pid) == node.pid
    except ProcessLookupError:
        return False


def alive(prefix: str) -> dict[str, int]:
    """actor id -> pid of the live actors whose class name starts with `prefix`."""
    return {a.actor_id: a.pid for a in list_actors(filters=[("state", "=", "ALIVE")], limit=10_000, detail=True,
                                                   raise_on_missing_output=False)
            if a.class_name.startswith(prefix) and a.pid}


class Chaos(threading.Thread):
    """Every ~mean_gap seconds (exponential gaps) kills one process of a random kind, or a whole worker node (which a
    replacement with the same resources then joins, as an autoscaler would start one), and waits for the recovery:
    as many live processes of each kind killed as before, the killed ones not among them. Each fault a dict in
    `faults`."""

    def __init__(self, address: str, nodes: dict[str, subprocess.Popen], mean_gap: float, seed: int):
        super().__init__(daemon=True, name="chaos")
        self.address, self.nodes, self.mean_gap, self.rng = address, nodes, mean_gap, random.Random(seed)
        self.faults, self.stopped, self.start_time = [], threading.Event(), time.monotonic()

    def run(self) -> None:
        while not self.stopped.wait(self.rng.expovariate(1 / self.mean_gap)):
            kind = self.rng.choice([*TARGETS, *self.nodes])
            before = {k: alive(prefix) for k, prefix in TARGETS.items()}
            fault = {"t_s": round(time.monotonic() - self.start_time, 1), "fault": kind,
                     "recovered_by": RECOVERED_BY[kind]}
            if kind in self.nodes:  # every process on it dies with it, and each must be replaced
                node = self.nodes[kind]
                dead = {pid for pids in before.values() for pid in pids.values() if on(node, pid)}
                kill_session(node)
                self.nodes[kind] = start_node(self.address, NODES[kind])
                watched = TARGETS
            elif before[kind]:
                fault["pid"] = pid = self.rng.choice(sorted(before[kind].values()))
                os.kill(pid, signal.SIGKILL)
                dead, watched = {pid}, {kind: TARGETS[kind]}
            else:
                continue  # none running now (the learner's rank while Ray Train restarts it, ...)
            killed = time.monotonic()
            fault["recovered_after_s"] = None
            while not self.stopped.is_set() and time.monotonic() - killed < 300:
                now = {k: alive(prefix) for k, prefix in watched.items()}
                if all(len(now[k]) >= len(before[k]) and not dead & set(now[k].values()) for k in watched):
                    fault["recovered_after_s"] = round(time.monotonic() - killed, 1)
                    break
                time.sleep(1)
            self.faults.append(fault)
            print(json.dumps(fault), flush=True)


def store_counts(run_path: Path, last_iteration: int) -> dict:
    """From the run's SQLite store: rollouts by status, those retried, and the policy server's LLM-call spans of the
    training rollouts' final attempts that have a reward (what the adapter reads; the evaluations' rollouts, sampled
    at temperature 0, left out), of the iterations up to the last one recorded (rollout.mode=async collects batches
    ahead, which a run's end leaves unread: their rollouts are in the group ids' `@iteration`)."""
    db = sqlite3.connect(f"file:{run_path / 'traces.sqlite'}?mode=ro", uri=True)
    db.execute("ATTACH DATABASE ? AS span_db", (f"file:{run_path / 'traces-spans.sqlite'}?mode=ro",))
    status = dict(db.execute("SELECT status, COUNT(*) FROM rollouts GROUP BY status").fetchall())
    retried = db.execute("SELECT COUNT(*) FROM rollouts WHERE attempts > 1").fetchone()[0]
    training = "json_extract(r.task, '$.sampling.temperature') IS NOT 0"
    group = "json_extract(r.task, '$.group_id')"
    final_calls = db.execute(
        "SELECT COUNT(*) FROM span_db.spans s JOIN rollouts r "
        "ON s.rollout_id = r.rollout_id AND s.attempt_id = r.attempt_id "
        f"WHERE s.name = ? AND s.origin = 'server' AND {training} AND r.reward IS NOT NULL "
        f"AND CAST(substr({group}, instr({group}, '@') + 1) AS INTEGER) <= ?", (LLM_CALL, last_iteration)).fetchone()[0]
    return {"rollouts_by_status": status, "rollouts_retried": retried, "final_attempt_llm_spans": final_calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="training minutes (trainer.max_minutes)")
    parser.add_argument("--mean-gap", type=float, default=40.0, help="mean seconds between faults")
    parser.add_argument("--seed", type=int, default=0)
    args, overrides = parser.parse_known_args()
    root = Path(__file__).resolve().parents[1] / "runs" / time.strftime("soak-%Y-%m-%d_%H-%M-%S")
    cfg = compose([
        f"model.path={resolve_model_path(ModelConfig())}", "engine=hf", "serve.num_replicas=2",
        "+serve.resources.policy_gpu=1", "+learner.resources_per_worker.trainer_gpu=1",
        "trainer.iterations=100000", f"trainer.max_minutes={args.minutes}", "trainer.eval_every=0",
        "trainer.checkpoint_every=1", "learner.max_restarts=1000", "task.eval_size=16",
        "rollout.num_workers=2", "rollout.agents_per_worker=8", "rollout.tasks_per_iteration=16",
        "rollout.group_size=4", "rollout.max_attempts=3", "rollout.unresponsive_seconds=10",
        "store.keep_iterations=null",  # every span kept: the read-once check counts them all
        *overrides, f"run_dir={root / 'run'}"])
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    ray.init(address=cluster.address, namespace="lightning_ray", log_to_driver=False)
    nodes = {kind: start_node(cluster.address, node) for kind, node in NODES.items()}
    chaos = Chaos(cluster.address, nodes, args.mean_gap, args.seed)
    start = time.perf_counter()
    try:
        chaos.start()
        history = train(cfg)
    finally:
        chaos.stopped.set()
        chaos.join(timeout=330)
        ray.shutdown()
        for node in nodes.values():
            kill_session(node)
        cluster.shutdown()
    minutes = (time.perf_counter() - start) / 60
    counts = store_counts(cfg.run_path, history[-1]["iteration"])
    trained = [h for h in history if h["updated"]]
    read = sum(h["policy_calls"] + h["unanswered_calls"] for h in history)
    synced = [h for h in history if h.get("served_policy_version") is not None]  # the iterations that synced
    checks = {
        "every_fault_recovered": all(f["recovered_after_s"] is not None for f in chaos.faults),
        "no_rollout_lost": set(counts["rollouts_by_status"]) <= set(FINAL),
        # the calls the adapter read (answered or not), against those of the final attempts in the store: a retried
        # rollout's earlier attempts, or a batch read twice, would make them differ
        "each_call_read_once": read == counts["final_attempt_llm_spans"],
        # the sync's barrier waits for every replica: the last one synced is the final version
        "replicas_serve_the_final_version": bool(synced) and
        synced[-1]["served_policy_version"] == history[-1]["policy_version"],
    }
    summary = {"benchmark": "soak", "minutes": round(minutes, 1), "iterations": len(history),
               "updates": len(trained), "rollouts": sum(h["rollouts"] for h in history),
               "rollouts_per_s": round(sum(h["rollouts"] for h in history) / (minutes * 60), 2),
               "faults": len(chaos.faults), "faults_by_kind": {k: sum(f["fault"] == k for f in chaos.faults)
                                                               for k in [*TARGETS, *NODES]},
               "calls_read": read, **counts,
               # rollout.mode=async: calls a weight update landed in (serve.drain=keep), and samples left out as stale
               "calls_across_updates": sum(h["calls_across_updates"] for h in history),
               "stale_dropped": sum(h.get("stale_dropped", 0) for h in history), "checks": checks,
               "passed": all(checks.values())}
    print(json.dumps(summary), flush=True)
    (root / "soak.json").write_text(json.dumps({**summary, "fault_log": chaos.faults,
                                                "overrides": overrides, "args": vars(args)}, indent=2) + "\n")


if __name__ == "__main__":
    main()
