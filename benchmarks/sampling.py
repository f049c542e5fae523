"""The HF engine's sampling step: the whole batch at once and read back once (ours) vs the same sampler a row at a
time, each row's token and logprob read back before the next (what the engine did before), side by side in one run.

    python benchmarks/sampling.py [--rows 1 8 32 64] [--vocab 151936] [--temperature 1.0] [--top-p 0.9]

Per step each side turns [rows, vocab] float32 logits into every row's token and its logprob on the host: the
tempered log-softmax, the top_p nucleus, the draw. On a CUDA GPU (where there is one) a read back per row waits for
the GPU each time. The vocabulary defaults to Qwen2.5's. Prints one JSON line per batch size: both sides'
milliseconds per step and the per-row side's time over ours (≥ 1: ours is faster).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from lightning_ray.serving.engines.sampling import sample


def batched(logits: torch.Tensor, temperature: float, top_p: float) -> list[tuple[int, float]]:
    rows = len(logits)
    tokens, logprobs = sample(logits, [temperature] * rows, [top_p] * rows, [None] * rows)
    return list(zip(tokens.tolist(), logprobs.gather(-1, tokens[:, None])[:, 0].tolist()))


def row_at_a_time(logits: torch.Tensor, temperature: float, top_p: float) -> list[tuple[int, float]]:
    out = []
    for row in logits:
        token, logprobs = sample(row[None], [temperature], [top_p], [None])
        out.append((int(token), logprobs[0, token].item()))
    return out


def per_step_ms(step, logits: torch.Tensor, args, repeats: int) -> float:
    step(logits, args.temperature, args.top_p)  # warm up (allocator, kernels)
    if logits.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        step(logits, args.temperature, args.top_p)
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    for rows in args.rows:
        logits = torch.randn(rows, args.vocab, device=device) * 3
        ours, per_row = (per_step_ms(f, logits, args, args.repeats) for f in (batched, row_at_a_time))
        print(json.dumps({"benchmark": "sampling", "device": torch.cuda.get_device_name() if device.type == "cuda"
                          else "cpu", "torch_threads": torch.get_num_threads(), "rows": rows, "vocab": args.vocab,
                          "temperature": args.temperature, "top_p": args.top_p, "batched_ms": round(ours, 3),
                          "row_at_a_time_ms": round(per_row, 3), "speedup": round(per_row / ours, 2)}), flush=True)


if __name__ == "__main__":
    main()
