"""Serving overhead: requests/s and tokens/s through the policy endpoint (Ray Serve + OpenAI API + trace
recording) vs the same HF engine called in-process, on the same tiny model, prompts and seeds, in one run.

    .venv/bin/python benchmarks/serve_overhead.py [--requests 64] [--concurrency 1 8 32]

Prints one JSON line per concurrency, with endpoint/direct ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import ray
import torch
from openai import AsyncOpenAI

from lightning_ray.models.tiny import build_tiny_model
from lightning_ray.serving.app import deploy_policy
from lightning_ray.serving.engines import SamplingParams
from lightning_ray.serving.engines.hf import HFEngine
from lightning_ray.store.trace_store import TraceStore
from lightning_ray.tasks import calc
from lightning_ray.training.weights import WeightRegistry


def conversations(n: int) -> list[list[dict]]:
    return [[{"role": "system", "content": calc.SYSTEM_PROMPT}, {"role": "user", "content": t.input["question"]}]
            for t in calc.make_tasks(n, seed=99)]


def direct(engine: HFEngine, convs, concurrency: int, max_tokens: int) -> tuple[float, int]:
    def one(i: int) -> int:
        ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(convs[i], tokenize=False,
                                                                         add_generation_prompt=True))
        return len(engine.generate(ids, SamplingParams(max_tokens=max_tokens, seed=i)).token_ids)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, range(len(convs))))
    return time.perf_counter() - start, tokens


async def endpoint(url: str, convs, concurrency: int, max_tokens: int) -> tuple[float, int]:
    client = AsyncOpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> int:
        async with gate:
            out = await client.chat.completions.create(model="tiny", messages=convs[i], max_tokens=max_tokens, seed=i)
            return out.usage.completion_tokens

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(len(convs)))))
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as in the serve replica
    model = build_tiny_model(tempfile.mkdtemp() + "/tiny")
    convs = conversations(args.requests)
    engine = HFEngine(str(model))
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    store = TraceStore.remote(tempfile.mkdtemp() + "/traces.sqlite")
    url = deploy_policy(str(model), "tiny", store, WeightRegistry.remote(), port=8123)
    asyncio.run(endpoint(url, convs[:4], 1, args.max_tokens))  # warm-up
    direct(engine, convs[:4], 1, args.max_tokens)
    for c in args.concurrency:
        d_s, d_tok = direct(engine, convs, c, args.max_tokens)
        e_s, e_tok = asyncio.run(endpoint(url, convs, c, args.max_tokens))
        print(json.dumps({
            "benchmark": "serve_overhead", "engine": "hf", "concurrency": c, "requests": args.requests,
            "direct_rps": round(args.requests / d_s, 2), "endpoint_rps": round(args.requests / e_s, 2),
            "direct_tok_s": round(d_tok / d_s, 1), "endpoint_tok_s": round(e_tok / e_s, 1),
            "same_tokens": d_tok == e_tok, "endpoint_vs_direct": round((e_tok / e_s) / (d_tok / d_s), 3),
        }), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
