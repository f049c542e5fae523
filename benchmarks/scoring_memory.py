"""The learner's scoring of response tokens (learner/scoring.py `score`) vs the textbook way on the same batch:
peak memory and time of the forward and backward, side by side in one run.

    python benchmarks/scoring_memory.py [--tokens 480] [--vocab 151936] [--chunk-elements 16777216] [--entropy]

A one-layer model with a real vocabulary (Qwen2.5's 151,936 by default: the LM head's math, not the trunk, is what
is measured) in bf16 scores `--tokens` response tokens at temperature 0.7, then the loss (a policy-gradient term,
and with --entropy an entropy bonus) goes backward. Ours: the head's bf16 logits, their fp32 math a chunk of rows at a
time (`--chunk-elements` logits a chunk: scoring.SCORED_ELEMENTS, 2^26 in training; 2^24 here so that 480 tokens
make the ~4 chunks a GPU micro-batch of 16k tokens makes 37 of) recomputed in the backward. The textbook: fp32 logits,
log_softmax, gather, and the entropy from the same log-probabilities, all kept for the backward.
Memory is the process's peak resident set above what it held before, in units of one fp32 [tokens, vocabulary]
tensor (U); on a GPU the same tensors take the same bytes. Prints one JSON line per side, ours with its ratios.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import numpy as np
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lightning_ray.learner import scoring
from lightning_ray.types import Transition


def resident(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field))


def textbook(model, batch, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Every response position's fp32 logits at once, kept by autograd."""
    ids, predicts = batch["input_ids"], batch["mask"].bool()
    logits = model(input_ids=ids).logits[:, :-1][predicts].float()
    log_p = torch.log_softmax(logits / batch["temperature"][0], -1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return log_p.gather(-1, ids[:, 1:][predicts][:, None]).squeeze(-1), entropy if entropy_grad else entropy.detach()


def ours(model, batch, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    scores = scoring.score(model, batch, entropy_grad=entropy_grad)
    return scores.logprobs, scores.entropy


def measure(side, model, batch, entropy_grad: bool, unit: int) -> dict:
    model.zero_grad(set_to_none=True)
    gc.collect()
    before = resident("VmRSS")
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # the peak (VmHWM) from here
    start = time.perf_counter()
    logprobs, entropy = side(model, batch, entropy_grad)
    held = resident("VmRSS") - before
    (-(logprobs * batch["weights"]).sum() - 0.01 * (entropy * batch["weights"]).sum()).backward()
    return {"seconds": round(time.perf_counter() - start, 3), "peak_U": round((resident("VmHWM") - before) / unit, 2),
            "held_for_backward_U": round(held / unit, 2), "logprobs": logprobs.detach()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=480)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--chunk-elements", type=int, default=1 << 24)
    parser.add_argument("--entropy", action="store_true", help="an entropy bonus in the loss (its gradient kept)")
    args = parser.parse_args()
    scoring.SCORED_ELEMENTS = args.chunk_elements
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=args.vocab, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                         tie_word_embeddings=False)).to(torch.bfloat16)
    n = args.tokens
    episode = Transition(rollout_id="r", group_id="g", span_id="s", prompt_ids=np.arange(8),
                         response_ids=np.arange(n) + 10, logprobs=np.zeros(n), reward=1.0, policy_version=0,
                         temperature=0.7)
    batch = scoring.collate([(episode, 1.0 / n)], pad_id=0)
    unit = n * args.vocab * 4
    results = {name: measure(side, model, batch, args.entropy, unit) for name, side in
               (("textbook", textbook), ("ours", ours), ("textbook_again", textbook), ("ours_again", ours))}
    common = {"tokens": n, "vocab": args.vocab, "entropy_grad": args.entropy, "U_MiB": round(unit / 2**20),
              "chunk_rows": args.chunk_elements // args.vocab, "threads": torch.get_num_threads()}
    base, mine = (min((results[k], results[k + "_again"]), key=lambda r: r["seconds"]) for k in ("textbook", "ours"))
    assert torch.allclose(base["logprobs"], mine["logprobs"], atol=1e-3), "the two score differently"
    print(json.dumps({"side": "textbook", **common, **{k: v for k, v in base.items() if k != "logprobs"}}))
    print(json.dumps({"side": "ours", **common, **{k: v for k, v in mine.items() if k != "logprobs"},
                      "peak_vs_textbook": round(mine["peak_U"] / base["peak_U"], 3),
                      "time_vs_textbook": round(mine["seconds"] / base["seconds"], 3)}))


if __name__ == "__main__":
    main()
