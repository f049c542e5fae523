"""Agent Lightning 0.3.0's stores on the shared workload (store_workload.py): the peer side of the store benchmark.

Runs in Agent Lightning's own venv, not the project's:

    bash envs/agentlightning/build.sh
    .venvs/agentlightning/bin/python benchmarks/agl_store.py [--spans N] [--http-spans N] [--rollouts N] ...

Prints one JSON line per measurement: {"store", "metric", "api", "value", "n", "seconds"}; "api" tells the per-item
calls (add_span, as their tracer and runner send spans) from the batched one (add_many_spans).

What is timed: only the store calls. Spans: building their `Span` objects from the workload dicts, and creating the
rollouts/attempts the spans belong to (start_rollout), happen before the clock starts; the timed loop is the
add_span / add_many_spans calls, which over HTTP includes the client's serialization and the server's validation.
Rollouts: enqueue_rollout for all n, then dequeue_rollout + update_attempt(status="succeeded") for each, all timed.
In-memory: the store is called directly in this process (a fresh InMemoryLightningStore() per measurement, their
Trainer's default for in-process runs). HTTP: a fresh `agl store` server process per measurement (InMemory backend,
thread-safe, asyncio launch mode: their CLI's defaults) on 127.0.0.1, driven by LightningStoreClient from here;
server start-up is not timed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm (imported by agentlightning) must not fetch

from agentlightning import Span  # noqa: E402
from agentlightning.store import InMemoryLightningStore, LightningStoreClient  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from store_workload import make_spans  # noqa: E402


def emit(store: str, metric: str, api: str, n: int, seconds: float) -> None:
    print(json.dumps({"store": store, "metric": metric, "api": api, "value": round(n / seconds, 1), "n": n,
                      "seconds": round(seconds, 3)}), flush=True)


@contextlib.asynccontextmanager
async def http_store():
    """A fresh `agl store` server process on a free loopback port, and a client to it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.TemporaryFile()  # uvicorn's access lines; shown only if the server fails to start
    server = subprocess.Popen([sys.executable, "-m", "agentlightning.cli.store", "--host", "127.0.0.1",
                               "--port", str(port), "--log-level", "WARNING"], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            with contextlib.suppress(OSError):
                urllib.request.urlopen(url + "/v1/agl/health", timeout=1)
                break
            if server.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"agl store exited with {server.returncode}:\n{log.read().decode()[-3000:]}")
            await asyncio.sleep(0.2)
        client = LightningStoreClient(url)
        try:
            yield client
        finally:
            await client.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


async def to_agl_spans(store, dicts: list[dict]) -> list[Span]:
    """Untimed: one rollout+attempt per workload rollout (the store makes the ids), then their Span objects."""
    ids = {}
    for rid in dict.fromkeys(d["rollout_id"] for d in dicts):
        attempted = await store.start_rollout(input={"task": rid})
        ids[rid] = (attempted.rollout_id, attempted.attempt.attempt_id)
    seq: dict[str, int] = {}
    spans = []
    for d in dicts:
        rollout_id, attempt_id = ids[d["rollout_id"]]
        seq[rollout_id] = seq.get(rollout_id, 0) + 1
        spans.append(Span.from_attributes(
            attributes=d["attributes"], rollout_id=rollout_id, attempt_id=attempt_id, sequence_id=seq[rollout_id],
            name=d["name"], trace_id=d["trace_id"], span_id=d["span_id"], parent_id=d["parent_id"],
            start_time=d["start_time"], end_time=d["end_time"]))
    return spans


async def spans_per_s(name: str, store, dicts: list[dict], batch: int) -> None:
    spans = await to_agl_spans(store, dicts)
    t = time.perf_counter()
    if batch <= 1:
        for span in spans:
            await store.add_span(span)
    else:
        for i in range(0, len(spans), batch):
            await store.add_many_spans(spans[i:i + batch])
    seconds = time.perf_counter() - t
    stored = await store.query_spans(spans[0].rollout_id)
    assert len(stored) == sum(s.rollout_id == spans[0].rollout_id for s in spans), "spans went missing"
    emit(name, "spans_per_s", "add_span" if batch <= 1 else f"add_many_spans[{batch}]", len(spans), seconds)


async def rollouts_per_s(name: str, store, n: int) -> None:
    t = time.perf_counter()
    for i in range(n):
        await store.enqueue_rollout(input={"task": i})
    for _ in range(n):
        attempted = await store.dequeue_rollout(worker_id="w0")
        await store.update_attempt(attempted.rollout_id, attempted.attempt.attempt_id, status="succeeded")
    seconds = time.perf_counter() - t
    assert await store.dequeue_rollout() is None
    emit(name, "rollouts_per_s", "enqueue_rollout+dequeue_rollout+update_attempt", n, seconds)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--spans", type=int, default=5000, help="spans for the in-memory store")
    p.add_argument("--http-spans", type=int, default=500, help="spans through HTTP")
    p.add_argument("--rollouts", type=int, default=3000, help="rollouts for the in-memory store")
    p.add_argument("--http-rollouts", type=int, default=600, help="rollouts through HTTP")
    p.add_argument("--workload-rollouts", type=int, default=100, help="rollouts the spans are spread over")
    p.add_argument("--batch", type=int, default=512, help="add_many_spans batch size (0: skip the batched runs)")
    p.add_argument("--only", choices=["inmemory", "http"], help="run one store only")
    args = p.parse_args()

    batches = [1] + ([args.batch] if args.batch > 1 else [])
    if args.only != "http":
        dicts = make_spans(args.spans, args.workload_rollouts)
        for batch in batches:
            await spans_per_s("agentlightning-inmemory", InMemoryLightningStore(), dicts, batch)
        await rollouts_per_s("agentlightning-inmemory", InMemoryLightningStore(), args.rollouts)
    if args.only != "inmemory":
        dicts = make_spans(args.http_spans, args.workload_rollouts)
        for batch in batches:
            async with http_store() as store:
                await spans_per_s("agentlightning-http", store, dicts, batch)
        async with http_store() as store:
            await rollouts_per_s("agentlightning-http", store, args.http_rollouts)


if __name__ == "__main__":
    asyncio.run(main())
