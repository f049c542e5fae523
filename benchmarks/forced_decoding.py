"""Forced decoding (SamplingParams.forced_token_ids: a teacher's answer, a prompt scored for echo with logprobs) vs
decoding as many tokens a step at a time, on the same engine, prompts and token counts, side by side in one run.

    python benchmarks/forced_decoding.py [--engines hf vllm] [--model DIR]

Both engines score forced tokens in one forward pass over the prompt and the forced tokens (the HF engine until
2026-12-06 ran them a step each, as a sampled generation runs: the baseline's cost). Two settings: a teacher's answer
(32 tokens after a 300-token prompt) and a prompt scored (399 tokens after its first). Prints one JSON line per engine
and setting: seconds per call for each side (the median of --repeats) and the step-wise side's over forced's (≥ 1:
forced is faster). The model defaults to SmolLM2-135M-Instruct (model=smollm2, built from its PyPI package).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

from lightning_ray.config.schema import ModelConfig
from lightning_ray.models import SMOLLM2, resolve_model_path
from lightning_ray.serving.engines import SamplingParams, generate, make_engine

TEXT = " ".join(f"Question {i}: what is {i} times {i + 3}? Answer: {i * (i + 3)}." for i in range(60))
SETTINGS = {"teacher_answer": (300, 32), "prompt_scored": (1, 399)}  # prompt tokens, forced tokens


async def seconds(engine, prompt: list[int], params: SamplingParams, repeats: int) -> float:
    await generate(engine, prompt, params)  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        await generate(engine, prompt, params)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def main(args) -> None:
    torch.set_num_threads(1)  # as in a Serve replica
    path = args.model or str(resolve_model_path(ModelConfig(path=SMOLLM2)))
    for kind in args.engines:
        engine = make_engine(kind, path, max_model_len=1024)
        ids = engine.tokenizer.encode(TEXT)
        for setting, (prompt_len, forced_len) in SETTINGS.items():
            prompt, forced = ids[:prompt_len], ids[prompt_len:prompt_len + forced_len]
            k = 1 if setting == "prompt_scored" else 0  # lm-eval's logprobs=1
            common = {"max_tokens": forced_len, "ignore_eos": True, "top_logprobs": k, "incremental": False}
            one_pass = await seconds(engine, prompt, SamplingParams(**common, forced_token_ids=forced), args.repeats)
            stepwise = await seconds(engine, prompt, SamplingParams(**common, temperature=0), args.repeats)
            print(json.dumps({"benchmark": "forced_decoding", "engine": kind, "model": path, "setting": setting,
                              "prompt_tokens": prompt_len, "forced_tokens": forced_len, "torch_threads": 1,
                              "forced_s": round(one_pass, 4), "decoded_stepwise_s": round(stepwise, 4),
                              "speedup": round(stepwise / one_pass, 2)}), flush=True)
        if kind == "vllm":
            engine.shutdown()


if __name__ == "__main__":  # vLLM spawns processes
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", choices=["hf", "vllm"], default=["hf", "vllm"])
    parser.add_argument("--model", help="a model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--repeats", type=int, default=5)
    asyncio.run(main(parser.parse_args()))
