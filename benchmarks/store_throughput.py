"""Trace-store throughput, ours vs Agent Lightning 0.3.0's stores, on the same workload (store_workload.py).

    .venv/bin/python benchmarks/store_throughput.py [--spans N] [--http-spans N] [--rollouts N] [--http-rollouts N]
                                                    [--no-peer]

Ours, through the path agents use: Span objects handed to StoreClient.add_spans (the policy server and the worker's
tracer do exactly this) → rows encoded on the sender → Ray actor call → SQLite WAL commit in a run directory;
also the in-memory backend, and the HTTP path an agent outside Ray uses (LightningClient → Serve → store).
Theirs (`agl_store.py` in .venvs/agentlightning, built by envs/agentlightning/build.sh): InMemoryLightningStore
called in-process, and their HTTP client/server store. As on their side, building Span objects from the workload
dicts and creating the rollouts happen before the clock starts. Both sides get the same counts (spans, HTTP spans,
rollouts, HTTP rollouts, span batch). Prints a JSON line per measurement, then ratios: each of our APIs against
their fastest on the same n, naming both APIs and n. Theirs has no batch call for rollouts: our batched ones
(--batched-rollouts of them) get a ratio only where that n is also --rollouts (in-process) or --http-rollouts.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import ray

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from store_workload import make_spans  # noqa: E402

from lightning_ray.rollout.batching import BatchedStore  # noqa: E402
from lightning_ray.store.client import StoreClient  # noqa: E402
from lightning_ray.types import Rollout, Span, Task, Verdict, new_id  # noqa: E402

PEER_PYTHON = HERE.parent / ".venvs/agentlightning/bin/python"


def emit(store: str, metric: str, api: str, n: int, seconds: float) -> dict:
    line = {"store": store, "metric": metric, "api": api, "value": round(n / seconds, 1), "n": n,
            "seconds": round(seconds, 3)}
    print(json.dumps(line), flush=True)
    return line


def our_spans(store, dicts: list[dict]) -> list[Span]:
    """Untimed: the workload's rollouts queued in our store (it names them), then our Span objects."""
    names = list(dict.fromkeys(d["rollout_id"] for d in dicts))
    ids = dict(zip(names, (r.rollout_id for r in store.enqueue([Task(task_id=n, input={}) for n in names]))))
    return [Span(**{**d, "rollout_id": ids[d["rollout_id"]]}) for d in dicts]


@ray.remote(num_cpus=0)
class Sender:
    """A process that sends spans as a rollout worker or a server replica does: Span objects → store.add_spans."""

    def __init__(self, connect, spans: list[Span], batch: int):
        self.store, self.batches = connect(), [spans[i:i + batch] for i in range(0, len(spans), batch)]

    def send(self) -> int:
        for b in self.batches:
            self.store.add_spans(b)
        return sum(map(len, self.batches))


def spans_per_s(name: str, connect, dicts: list[dict], batch: int, senders: int) -> dict:
    """`senders` processes send at once, as rollout workers and server replicas do; `connect()` gives the client."""
    store = connect()
    spans = our_spans(store, dicts)
    actors = [Sender.remote(connect, spans[i::senders], batch) for i in range(senders)]
    ray.get([a.__ray_ready__.remote() for a in actors])
    t = time.perf_counter()
    n = sum(ray.get([a.send.remote() for a in actors]))
    seconds = time.perf_counter() - t
    assert len(store.query_spans([spans[0].rollout_id])) == sum(s.rollout_id == spans[0].rollout_id for s in spans)
    for a in actors:
        ray.kill(a)
    return emit(name, "spans_per_s", f"add_spans[{batch}] x {senders} sender processes", n, seconds)


def rollouts_per_s(name: str, store, n: int) -> dict:
    """One at a time: a call per dequeue and per verdict."""
    t = time.perf_counter()
    store.enqueue([Task(task_id=str(i), input={"task": i}) for i in range(n)])
    while (rollout := store.dequeue("w0")) is not None:
        store.finish_attempt(rollout.rollout_id, rollout.attempt_id, "succeeded", reward=1.0)
    return emit(name, "rollouts_per_s", "enqueue+dequeue+finish_attempt", n, time.perf_counter() - t)


def batched_rollouts_per_s(name: str, store, n: int, k: int) -> dict:
    """k at a time: one dequeue_batch and one finish_attempts call per k rollouts."""
    t = time.perf_counter()
    store.enqueue([Task(task_id=str(i), input={"task": i}) for i in range(n)])
    while leased := [r for r in store.dequeue_batch([new_id("at") for _ in range(k)], "w0") if r is not None]:
        outcomes = store.finish_attempts([Verdict(rollout_id=r.rollout_id, attempt_id=r.attempt_id, status="succeeded",
                                                  reward=1.0) for r in leased])
        assert all(isinstance(o, Rollout) for o in outcomes), outcomes
    return emit(name, "rollouts_per_s", f"enqueue+dequeue_batch[{k}]+finish_attempts", n, time.perf_counter() - t)


def slots_rollouts_per_s(name: str, store, n: int, slots: int) -> dict:
    """As a rollout worker runs them: `slots` threads, each dequeuing and finishing one rollout at a time through one
    BatchedStore, which sends what they ask at once as one batch call (rollout/batching.py)."""
    batched = BatchedStore(store)

    def slot() -> None:
        while (rollout := batched.dequeue("w0")) is not None:
            batched.finish_attempt(rollout.rollout_id, rollout.attempt_id, "succeeded", reward=1.0)

    t = time.perf_counter()
    store.enqueue([Task(task_id=str(i), input={"task": i}) for i in range(n)])
    threads = [threading.Thread(target=slot) for _ in range(slots)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return emit(name, "rollouts_per_s", f"enqueue+dequeue+finish_attempt x {slots} slots, batched", n,
                time.perf_counter() - t)


@contextmanager
def fresh(path: str | Path | None = None):
    """A store of its own for one measurement, ended after it: a measured store's WAL checkpoints (hundreds of MB
    after the spans) must not run beside the next measurement."""
    store = StoreClient.start(path) if path else StoreClient.start()
    try:
        yield store
    finally:
        store.close()


def ours(args) -> list[dict]:
    from lightning_ray.client import LightningClient
    from lightning_ray.serving.deploy import delete_apps
    from lightning_ray.store.http import APP_NAME, deploy_store_api

    ray.init(num_cpus=args.senders, include_dashboard=False, log_to_driver=False)
    dicts = make_spans(args.spans, args.workload_rollouts)
    out = []
    with tempfile.TemporaryDirectory() as run_dir:
        with fresh(run_dir) as store:
            out.append(spans_per_s("lightning_ray-sqlite", partial(StoreClient, store.shards), dicts, args.batch,
                                   args.senders))
        with fresh(Path(run_dir) / "q") as store:
            out.append(rollouts_per_s("lightning_ray-sqlite", store, args.rollouts))
        with fresh(Path(run_dir) / "qb") as store:
            out.append(batched_rollouts_per_s("lightning_ray-sqlite", store, args.batched_rollouts, args.k))
        with fresh(Path(run_dir) / "qs") as store:
            out.append(slots_rollouts_per_s("lightning_ray-sqlite", store, args.batched_rollouts, args.slots))
    with fresh() as store:
        out.append(spans_per_s("lightning_ray-memory", partial(StoreClient, store.shards), dicts, args.batch,
                               args.senders))
    with tempfile.TemporaryDirectory() as run_dir:
        url = deploy_store_api(StoreClient.start(run_dir), port=args.port)
        out.append(spans_per_s("lightning_ray-http", partial(LightningClient, url), dicts[:args.http_spans],
                               args.batch, args.senders))
        out.append(rollouts_per_s("lightning_ray-http", LightningClient(url), args.http_rollouts))
        out.append(batched_rollouts_per_s("lightning_ray-http", LightningClient(url), args.batched_rollouts, args.k))
        delete_apps([APP_NAME])
    ray.shutdown()
    return out


def peer(args) -> list[dict]:
    # idempotent: builds .venvs/agentlightning (~5 min) unless its .installed stamp is there
    subprocess.run(["bash", str(HERE.parent / "envs/agentlightning/build.sh")], check=True)
    # the same counts as ours: with only --spans passed, theirs ran its own defaults (3,000 rollouts against our
    # 2,000, 500 HTTP spans against 5,000, ...)
    counts = {"--spans": args.spans, "--http-spans": args.http_spans, "--rollouts": args.rollouts,
              "--http-rollouts": args.http_rollouts, "--workload-rollouts": args.workload_rollouts,
              "--batch": args.batch}
    run = subprocess.run([str(PEER_PYTHON), str(HERE / "agl_store.py"), *(str(x) for kv in counts.items() for x in kv)],
                         capture_output=True, text=True, check=True)
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    for line in lines:
        print(json.dumps(line), flush=True)
    return lines


def ratios(lines: list[dict], mine: str, theirs: str, metric: str) -> list[dict]:
    """Each of our APIs over their fastest on the same n, the same work (a rate at 20,000 rollouts against one at
    3,000 is not); none where they measured no such n."""
    out = []
    for a in (line for line in lines if line["store"] == mine and line["metric"] == metric):
        same = [line for line in lines if line["store"] == theirs and line["metric"] == metric and line["n"] == a["n"]]
        if same:
            b = max(same, key=lambda line: line["value"])
            out.append({"ratio": f"{mine} / {theirs}", "metric": metric, "api": f"{a['api']} / {b['api']}",
                        "n": a["n"], "value": round(a["value"] / b["value"], 2)})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--spans", type=int, default=20_000)
    p.add_argument("--http-spans", type=int, default=5_000)
    p.add_argument("--batch", type=int, default=512,
                   help="spans per add_spans call (512: what OTel's BatchSpanProcessor and our tracer send)")
    p.add_argument("--senders", type=int, default=4, help="processes sending span batches at once")
    p.add_argument("--rollouts", type=int, default=2_000)
    p.add_argument("--http-rollouts", type=int, default=300)
    p.add_argument("--batched-rollouts", type=int, default=20_000, help="rollouts of each batched measurement")
    p.add_argument("--k", type=int, default=64, help="rollouts per dequeue_batch / finish_attempts call")
    p.add_argument("--slots", type=int, default=16, help="agent slots of the worker-like measurement")
    p.add_argument("--workload-rollouts", type=int, default=100)
    p.add_argument("--port", type=int, default=8321)
    p.add_argument("--no-peer", action="store_true", help="skip Agent Lightning")
    args = p.parse_args()

    lines = ours(args) + ([] if args.no_peer else peer(args))
    if args.no_peer:
        return
    for metric in ("spans_per_s", "rollouts_per_s"):
        for mine, theirs in (("lightning_ray-sqlite", "agentlightning-inmemory"),
                             ("lightning_ray-http", "agentlightning-http")):
            for line in ratios(lines, mine, theirs, metric):
                print(json.dumps(line))


if __name__ == "__main__":
    main()
