"""One policy update on the same batch: our learner (Ray Train + DeepSpeed, in the worker × thread layouts asked
for) vs a bare single-process PyTorch step of the same loss on the same hardware, side by side in one run.

    python benchmarks/update_speed.py [--layouts 1x2 2x1] [--transitions 128] [--steps 2] [--micro-batch-tokens 2048]
        [--lora]   # and each layout (and the bare step) with LoRA (learner.lora={}), its update's speed against full's
        [--lora-layers 15 8]   # and with LoRA on the top 15, then 8 layers only (learner.lora={layers: N})
        [--frozen-bound]   # and the bare step with every weight frozen and no adapter: the most LoRA can gain
        [--unshared]   # and each of those with learner.shared_prefix=false, the default's speed against it
        [--cpu-env]    # and each (the bare steps too) with configs/placement/cpu.yaml's learner.env, a run's on CPUs
        [--also dtype=bfloat16 dtype=bfloat16,attn_implementation=sdpa]   # and each with these learner settings
        [--task sql]   # the sql writer's calls (a ~470-token schema prompt each) instead of calc episodes
    python benchmarks/update_speed.py --model qwen2.5-0.5b --prompt-tokens 768 --response-tokens 256 \
        --transitions 64 --micro-batch-tokens 8192 --layouts 1x4 --steps 3                      # on a GPU

On a CUDA GPU both sides run bf16 with activation checkpointing and fused AdamW (ours: DeepSpeed's bf16 mode, which
also keeps fp32 master weights; the bare loop steps its bf16 weights directly, as the anchors in the GPU node's notes
were measured), one GPU each, the learner alone on its GPU. The bare step is the textbook one, sharing none of
the learner's code but how rows group into micro-batches (since 2026-12-07: the figures recorded before compare with
a bare step that ran the learner's own collate and scoring). `--model qwen2.5-0.5b|qwen2.5-1.5b` builds a
random-init model of that shape (no download); `--prompt-tokens/--response-tokens` then make a synthetic batch.

The batch: 64 calc episodes in the text protocol, as the trajectory level trains them (one sequence per episode,
~150 tokens with SmolLM2's template): what an iteration of 16 tasks × 4 rollouts trains on. `--task sql`: the sql
workflow's writer calls for 16 questions × 4 rollouts (its system prompt, the Chinook schema and the question, ~470
tokens; the gold query as the response), where rows share long prompt prefixes (learner.shared_prefix).
Each side takes `--steps` steps; the first warms up (allocations, DeepSpeed's buffers), the rest are timed. Ours
includes publishing the new weights to the registry, as in training: on CPUs the state dict into Ray's object store,
on a GPU CUDA IPC handles, as placement=colocated publishes them.
Prints one JSON line per side, the learner's with its ratio to the bare step (bare seconds / ours: ≥ 1 is faster;
each side's mean over the same timed steps, update_speed_vs_bare on rank 0's update alone, without the publish).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from unittest.mock import patch

import ray
import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from lightning_ray.config import LoraConfig, ModelConfig, compose, validate
from lightning_ray.learner import lora
from lightning_ray.learner.driver import Learner, micro_batches, padded_size, zero_stage
from lightning_ray.models import SMOLLM2, resolve_model_path
from lightning_ray.models.shaped import QWEN2_5, shaped_model
from lightning_ray.tasks import calc
from lightning_ray.types import Transition
from lightning_ray.weight_sync.registry import WeightRegistry


def make_batch(model_path, n: int, seed: int = 0) -> list[Transition]:
    """n episodes of the calc agent's text protocol as the trajectory level trains them: one sequence each, the
    prompt up to the question, then the episode's turns (CALC, RESULT, ANSWER) as the response."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rng = random.Random(seed)
    out = []
    for i, (task, episode) in enumerate(zip(tasks := calc.make_tasks(n, seed=seed, protocol="text"),
                                            calc.demonstrations(tasks))):
        prompt = _encode(tokenizer, episode[:-3], generation_prompt=True)
        response = _encode(tokenizer, episode, generation_prompt=False)[len(prompt):]
        out.append(Transition(rollout_id=f"r{i}", group_id=f"g{i // 4}", span_id=f"s{i}", prompt_ids=prompt,
                              response_ids=response, logprobs=[-1.0] * len(response), reward=1.0,
                              advantage=rng.choice([-1.0, 1.0]), policy_version=0, temperature=0.7))
    return out


def sql_batch(model_path, n: int, seed: int = 0) -> list[Transition]:
    """n writer calls of the sql workflow, 4 per question (a group): its prompt, the gold query as the response."""
    from lightning_ray.tasks import sql
    from lightning_ray.tasks.sql.workflow import WRITER_PROMPT

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rng = random.Random(seed)
    out = []
    for q, task in enumerate(sql.make_tasks(-(-n // 4), seed=seed)):
        messages = [{"role": "system", "content": WRITER_PROMPT},
                    {"role": "user",
                     "content": f"Schema:\n{task.input['schema']}\n\nQuestion: {task.input['question']}"}]
        prompt = _encode(tokenizer, messages, generation_prompt=True)
        answer = {"role": "assistant", "content": f"```sql\n{task.reference['gold']}\n```"}
        response = _encode(tokenizer, [*messages, answer], generation_prompt=False)[len(prompt):]
        out += [Transition(rollout_id=f"r{q}-{i}", group_id=f"g{q}", span_id=f"s{q}-{i}", prompt_ids=prompt,
                           response_ids=response, logprobs=[-1.0] * len(response), reward=1.0,
                           advantage=rng.choice([-1.0, 1.0]), policy_version=0, temperature=0.7) for i in range(4)]
    return out[:n]


def _encode(tokenizer, messages, generation_prompt: bool) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False,
                                                          add_generation_prompt=generation_prompt),
                            add_special_tokens=False)  # as the policy server encodes chats


def synthetic_batch(vocab: int, n: int, prompt: int, response: int, seed: int = 0) -> list[Transition]:
    g = torch.Generator().manual_seed(seed)
    return [Transition(rollout_id=f"r{i}", group_id=f"g{i // 4}", span_id=f"s{i}",
                       prompt_ids=torch.randint(vocab, (prompt,), generator=g).tolist(),
                       response_ids=torch.randint(vocab, (response,), generator=g).tolist(),
                       logprobs=[-1.0] * response, reward=1.0, advantage=1.0 if i % 2 else -1.0, policy_version=0,
                       temperature=1.0) for i in range(n)]


def bare_steps(model_path, batch, steps: int, token_budget: int, threads: int, trains: str = "all") -> list[float]:
    """The baseline: one process, plain PyTorch AdamW, `textbook_loss` over the same micro-batches (rows by length,
    as many as the token budget holds), sharing none of the learner's scoring (until 2026-12-07 it ran the learner's
    own collate and score, so their costs showed on both sides). trains: `all` the weights, `lora` adapters
    (learner.lora's defaults), or `nothing`: no weight trains, yet the gradient flows back through every layer to
    the embeddings' output — what a frozen base costs before any adapter, LoRA's floor (its adapters only add to it)."""
    torch.set_num_threads(threads)
    cuda = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16 if cuda else torch.float32)
    if cuda:
        model = model.cuda()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    if trains == "lora":
        model = lora.with_adapter(model, LoraConfig())
    if trains == "nothing":
        model.requires_grad_(False)
        model.enable_input_require_grads()
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-6, fused=cuda) if trained else None
    tokens = sum(len(t.response_ids) for t in batch)  # token_mean: each response token weighs 1/tokens
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        for mb in micro_batches([(t, 0.0) for t in batch], token_budget):
            textbook_loss(model, [t for t, _ in mb], tokens).backward()
        if optimizer:
            torch.nn.utils.clip_grad_norm_(trained, 1.0)
            optimizer.step()
            optimizer.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def textbook_loss(model, rows: list[Transition], tokens: int) -> torch.Tensor:
    """The policy-gradient loss of `rows`, each response token weighing 1/tokens (token_mean over the batch): the
    clipped surrogate at ratio 1 (one epoch, on-policy), whose gradient is the policy gradient's. Right-padded rows
    through the decoder, the LM head on the positions that predict a response token, log-softmax in fp32 at each
    row's temperature."""
    device = model.device
    sequences = [[*t.prompt_ids, *t.response_ids] for t in rows]
    ids = torch.tensor([s + [0] * (max(map(len, sequences)) - len(s)) for s in sequences], device=device)
    predicts = torch.zeros(ids.shape, dtype=torch.bool)
    for i, t in enumerate(rows):
        predicts[i, len(t.prompt_ids) - 1 : len(sequences[i]) - 1] = True
    predicts = predicts.to(device)
    per_row = lambda values: torch.tensor(values, device=device)[:, None].expand(ids.shape)[predicts]  # noqa: E731
    hidden = model.get_decoder()(input_ids=ids).last_hidden_state[predicts]
    logits = model.get_output_embeddings()(hidden).float() / per_row([t.temperature for t in rows])[:, None]
    logprobs = logits.log_softmax(-1).gather(-1, ids.roll(-1, 1)[predicts][:, None]).squeeze(-1)
    return -(per_row([t.advantage for t in rows]) * torch.exp(logprobs - logprobs.detach())).sum() / tokens


def learner_config(token_budget: int, workers: int, threads: int, stage: str | int, learner: dict, cuda: bool):
    """The run's config of the learner alone: on a GPU it publishes as placement=colocated does (CUDA IPC handles,
    or LoRA's adapter), to replicas that would share its GPU (half of it each, as colocated asks Ray: the learner
    still has the whole GPU, nothing else runs there), or with several ranks as placement=split does (a GPU each); on
    CPUs through the object store."""
    device = {"CPU": 1} if not cuda else {"CPU": 1, "GPU": 0.5} if workers == 1 else {"CPU": 1, "GPU": 1}
    transport = "auto" if not cuda else "cuda_ipc" if workers == 1 else "collective"
    return validate({"run_dir": tempfile.mkdtemp(), "serve": {"resources": device}, "learner": {**learner,
        "num_workers": workers, "threads_per_worker": threads, "micro_batch_tokens": token_budget, "lr": 1e-6,
        "zero_stage": stage, "resources_per_worker": device, "weight_sync": transport,
        "max_logprob_gap": None}})  # made-up served logprobs


def learner_steps(model_path, batch, steps: int, token_budget: int, workers: int, threads: int,
                  stage: str | int, learner: dict) -> tuple[list[float], list[float], dict]:
    """Step times, rank 0's compute seconds of each step, and its split of the last step (compute, optimizer,
    publish, digest) in seconds, with the ZeRO stage it ran. learner: settings of the variant (LoRA: {"lora": {}},
    learner.lora's defaults)."""
    cfg = learner_config(token_budget, workers, threads, stage, learner, torch.cuda.is_available())
    learner = Learner(cfg, model_path, WeightRegistry.remote())
    times, compute = [], []
    try:
        learner.wait_ready()  # the ranks' start is not a step
        for _ in range(steps):
            start = time.perf_counter()
            replies = learner.step(batch)
            times.append(time.perf_counter() - start)
            compute.append(replies[0]["compute_s"])
    finally:
        learner.close()
    return times, compute, {"zero_stage": zero_stage(cfg.learner),
                            **{k: round(v, 2) for k, v in replies[0].items() if k.endswith("_s")}}


DEVICE = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
spawn = multiprocessing.get_context("spawn")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="*", default=["1x2", "2x1"],
                        help="workers x threads per worker (none: the bare steps only)")
    parser.add_argument("--zero-stage", default="auto", help="auto: 0 for one worker, 2 for more (as training)")
    parser.add_argument("--transitions", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--micro-batch-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2, help="the bare step's torch threads (the cores)")
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "tiny", *QWEN2_5])
    parser.add_argument("--prompt-tokens", type=int, default=256, help="synthetic batch (all but smollm2)")
    parser.add_argument("--response-tokens", type=int, default=64)
    parser.add_argument("--lora", action="store_true",
                        help="each layout, and the bare step, also with LoRA (learner.lora={})")
    parser.add_argument("--lora-layers", type=int, nargs="+", default=[], metavar="N",
                        help="each layout also with LoRA on the top N layers only (learner.lora={layers: N})")
    parser.add_argument("--frozen-bound", action="store_true",
                        help="the bare step again with every weight frozen and no adapter (LoRA's floor)")
    parser.add_argument("--unshared", action="store_true",
                        help="each layout also with learner.shared_prefix=false (every row's prompt run whole)")
    parser.add_argument("--task", choices=["calc", "sql"], default="calc", help="the batch's calls (smollm2)")
    parser.add_argument("--cpu-env", action="store_true",
                        help="each variant also with configs/placement/cpu.yaml's learner.env (a run's on CPUs)")
    parser.add_argument("--also", nargs="+", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                        help="each variant also with these learner.* settings (one variant per argument)")
    args = parser.parse_args()
    if args.model == "smollm2":
        model_path = resolve_model_path(ModelConfig(path=SMOLLM2))
        batch = (sql_batch if args.task == "sql" else make_batch)(model_path, args.transitions)
    else:
        model_path = resolve_model_path(ModelConfig()) if args.model == "tiny" else shaped_model(args.model)
        vocab = AutoConfig.from_pretrained(model_path).vocab_size
        batch = synthetic_batch(vocab, args.transitions, args.prompt_tokens, args.response_tokens)
    work = {"transitions": len(batch), "response_tokens": sum(len(t.response_ids) for t in batch),
            **{key: sum(padded_size([t for t, _ in mb], share)
                        for mb in micro_batches([(t, 0.0) for t in batch], args.micro_batch_tokens, share))
               for key, share in [("padded_tokens", False), ("padded_tokens_shared_prefix", True)]}}
    # bare steps: full fine-tuning, with --lora LoRA, with --frozen-bound no weight trained; with --cpu-env each
    # also under placement=cpu's env (GLIBC_TUNABLES is read when a process starts: the child's, set around its spawn)
    env = compose(["run_dir=x"]).learner.env if args.cpu_env else {}  # what a run's config has (placement=cpu)
    tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in batch)
    bare = {}  # each bare side's step seconds
    for suffix, side_env in {"": {}, **({"_cpu_env": env} if env else {})}.items():
        for side, trains in [("bare_pytorch", "all"), *([("bare_lora", "lora")] if args.lora else []),
                             *([("bare_frozen_base", "nothing")] if args.frozen_bound else [])]:
            # in a child process, so its model and optimizer are gone (memory and all) before the next side starts
            with patch.dict(os.environ, side_env), ProcessPoolExecutor(1, mp_context=spawn) as pool:
                seconds = pool.submit(bare_steps, model_path, batch, args.steps, args.micro_batch_tokens,
                                      args.threads, trains).result()
            bare[side + suffix] = step_s = sum(seconds[1:]) / max(len(seconds) - 1, 1)
            print(json.dumps({"side": side + suffix, "model": args.model, "device": DEVICE, "threads": args.threads,
                              "seconds": seconds, "step_s": round(step_s, 2), "tokens_per_s": round(tokens / step_s),
                              # full fine-tuning's bare step over this one (a frozen base's: the most LoRA can gain)
                              **({"speed_vs_bare": round(bare["bare_pytorch" + suffix] / step_s, 3)}
                                 if trains != "all" else {}), **work}), flush=True)
    bare_s = bare["bare_pytorch"]
    if not args.layouts:
        return
    ray.init(num_cpus=4)  # as the training job starts it: the dashboard on (Ray Train polls its state API)
    variants = {"learner": {}, **({"learner_lora": {"lora": {}}} if args.lora else {}),
                **{f"learner_lora_top{n}": {"lora": {"layers": n}} for n in args.lora_layers}}
    if args.unshared:
        variants |= {f"{side}_unshared": {**learner, "shared_prefix": False} for side, learner in variants.items()}
    plain = dict(variants)
    for also in args.also:
        settings = {key: yaml.safe_load(value) for key, value in (kv.split("=", 1) for kv in also.split(","))}
        variants |= {f"{side}_{also}": {**learner, **settings} for side, learner in plain.items()}
    if args.cpu_env:
        variants |= {f"{side}_cpu_env": {**learner, "env": env} for side, learner in variants.items()}
    for layout in args.layouts:
        workers, threads = map(int, layout.split("x"))
        stage = args.zero_stage if args.zero_stage == "auto" else int(args.zero_stage)
        default_update_s = None
        for side, learner in variants.items():
            ours, compute, split = learner_steps(model_path, batch, args.steps, args.micro_batch_tokens, workers,
                                                 threads, stage, learner)
            ours_s = sum(ours[1:]) / max(len(ours) - 1, 1)
            # the step (its optimizer_s within: counted twice before 2026-12-07, ~1%), not the digest or the publish;
            # the mean over the same timed steps as bare_s (was the last step's alone against bare_s's mean)
            update_s = sum(compute[1:]) / max(len(compute) - 1, 1)
            default_update_s = default_update_s or update_s
            print(json.dumps({"side": side, "model": args.model, "task": args.task, "device": DEVICE,
                              "layout": layout, "seconds": ours, "compute_seconds": compute,
                              "step_s": round(ours_s, 2), "update_s": round(update_s, 2),
                              "speed_vs_bare": round(bare_s / ours_s, 3),
                              "update_tokens_per_s": round(tokens / update_s),
                              "update_speed_vs_bare": round(bare_s / update_s, 3),
                              # the default learner's update seconds over this variant's: > 1 is faster
                              **({"update_speed_vs_learner": round(default_update_s / update_s, 3)}
                                 if side != "learner" else {}),
                              **split, **work}), flush=True)


if __name__ == "__main__":
    main()
