"""Serving overhead: requests/s and tokens/s through the policy endpoint (Ray Serve + OpenAI API + trace
recording) vs the same engine driven in-process through its interface, on the same tiny model, prompts, seeds
and token counts, in one run.

    .venv/bin/python benchmarks/serve_overhead.py [--engine hf|vllm] [--requests 64] [--concurrency 1 8 32]

Prints one JSON line per concurrency, with the endpoint/direct ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time

import ray
import torch
from openai import AsyncOpenAI

from lightning_ray.config import ModelConfig
from lightning_ray.models import resolve_model_path
from lightning_ray.serving.app import deploy_policy
from lightning_ray.serving.engines import SamplingParams, generate, make_engine
from lightning_ray.store.trace_store import TraceStore
from lightning_ray.tasks import calc
from lightning_ray.training.weights import WeightRegistry


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
            out = await client.chat.completions.create(model="tiny", messages=convs[i], max_tokens=max_tokens, seed=i,
                                                       extra_body={"ignore_eos": True})
            return out.usage.completion_tokens
        return run
    return [job(i) for i in range(len(convs))]


async def measure(args, engine, url: str) -> None:
    convs = conversations(args.requests)
    client = AsyncOpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0)
    await bounded(4, direct_jobs(engine, convs[:4], args.max_tokens))  # warm-up both paths
    await bounded(4, endpoint_jobs(client, convs[:4], args.max_tokens))
    for c in args.concurrency:
        d_s, d_tok = await bounded(c, direct_jobs(engine, convs, args.max_tokens))
        e_s, e_tok = await bounded(c, endpoint_jobs(client, convs, args.max_tokens))
        print(json.dumps({
            "benchmark": "serve_overhead", "engine": args.engine, "concurrency": c, "requests": args.requests,
            "max_tokens": args.max_tokens, "direct_rps": round(args.requests / d_s, 2),
            "endpoint_rps": round(args.requests / e_s, 2), "direct_tok_s": round(d_tok / d_s, 1),
            "endpoint_tok_s": round(e_tok / e_s, 1), "same_tokens": d_tok == e_tok,
            "endpoint_vs_direct": round((e_tok / e_s) / (d_tok / d_s), 3),
        }), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # keep stdout for the JSON lines
    torch.set_num_threads(1)  # as in the serve replica
    model = str(resolve_model_path(ModelConfig()))
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    store = TraceStore.remote(tempfile.mkdtemp() + "/traces.sqlite")
    url = deploy_policy(model, "tiny", store, WeightRegistry.remote(), port=8123, engine=args.engine)

    async def run():  # the in-process engine lives on this loop (vLLM's AsyncLLM binds to its first loop)
        engine = make_engine(args.engine, model, max_model_len=512)
        await measure(args, engine, url)

    asyncio.run(run())
    ray.shutdown()


if __name__ == "__main__":
    main()
