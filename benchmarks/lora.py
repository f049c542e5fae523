"""LoRA against full fine-tuning on the same work: the main job (SmolLM2-135M on the calc task) trained for the same
iterations twice, once with every weight and once with adapters (learner.lora), side by side in one run: held-out
accuracy before and after, the learner's seconds per update, the sync's seconds and bytes, rank 0's peak memory.

    python benchmarks/lora.py [--iterations 8] [--lora-lr 1e-3] [key=value ...]   # Hydra overrides, both runs
        [--lora-only key=value ...]   # overrides for the LoRA run alone (last on the line)

What LoRA ships is learner.lora.sync's (auto: merged weights on CPUs, the adapter on GPUs):
`--lora '{sync: adapter}'` measures the adapter-only sync on CPUs.

LoRA wants a larger step than full fine-tuning (only the adapters move): --lora-lr (full: learner.lr, 2e-5 by
default); at 2e-4 LoRA was 9 points behind, at 1e-3 level (results/lora_calc.json, lora_calc_lr1e-3.json). Not
part of CI (15-25 min on 2 cores). Prints one JSON line per run and one of ratios, and writes lora.json in
runs/lora-<time>/.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from learning import trained

from lightning_ray.config import compose
from lightning_ray.weight_sync import of_run as weight_sync


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--lora-lr", type=float, default=1e-3)
    parser.add_argument("--lora", default="{}", help="learner.lora's value (default: rank 16, alpha 32, all linears)")
    parser.add_argument("--lora-only", nargs="+", default=[], metavar="KEY=VALUE",
                        help="Hydra overrides for the LoRA run alone (e.g. learner.dtype=bfloat16: its frozen base in "
                             "bf16 where the CPU has AMX)")
    args, overrides = parser.parse_known_args()
    root = Path(__file__).resolve().parents[1] / "runs" / time.strftime("lora-%Y-%m-%d_%H-%M-%S")
    every = [f"trainer.iterations={args.iterations}", f"trainer.eval_every={args.iterations}", "task.eval_size=100",
             *overrides]
    runs = {}
    lora_run = [f"learner.lora={args.lora}", f"learner.lr={args.lora_lr}", *args.lora_only]
    for name, extra in (("full", []), ("lora", lora_run)):
        cfg = compose([*every, *extra, f"run_dir={root / name}"])
        result = trained(cfg)
        records = [json.loads(line) for line in (cfg.run_path / "metrics.jsonl").read_text().splitlines()]
        updates = [r for r in records if r.get("updated")]
        runs[name] = {"run": name, **result,
                      # the step, its optimizer_s within (it was counted twice before 2026-12-07: ~1% on CPUs)
                      "update_s": round(sum(r["learner_seconds"]["compute_s"] for r in updates)
                                        / max(len(updates), 1), 2),
                      "sync_s": round(sum(r["seconds"].get("sync", 0.0) for r in updates) / max(len(updates), 1), 2),
                      "learner_peak_mib": max((r["learner_peak_mib"] for r in updates), default=None),
                      # what each sync ships: the whole policy, or (LoRA) peft's adapter files alone
                      "sync": weight_sync(cfg), "sync_bytes": shipped(cfg.run_path / "checkpoint", weight_sync(cfg))}
        print(json.dumps(runs[name]), flush=True)
    full, lora = runs["full"], runs["lora"]
    ratios = {"benchmark": "lora", "iterations": args.iterations,
              "accuracy_after": {k: r["accuracy"][-1][1] for k, r in runs.items()},
              "accuracy_gap_points": round(100 * (full["accuracy"][-1][1] - lora["accuracy"][-1][1]), 1),
              "update_speedup": round(full["update_s"] / lora["update_s"], 2) if lora["update_s"] else None,
              "sync_speedup": round(full["sync_s"] / lora["sync_s"], 2) if lora["sync_s"] else None,
              "sync_bytes_ratio": round(lora["sync_bytes"] / full["sync_bytes"], 4),
              "peak_memory_ratio": round(lora["learner_peak_mib"] / full["learner_peak_mib"], 2)
              if full["learner_peak_mib"] and lora["learner_peak_mib"] else None}
    print(json.dumps(ratios), flush=True)
    (root / "lora.json").write_text(json.dumps({**ratios, "runs": runs}, indent=2) + "\n")


def shipped(checkpoint: Path, sync: str) -> int:
    files = (checkpoint.resolve().parent / "adapter").iterdir() if sync == "adapter" else \
        checkpoint.glob("*.safetensors")
    return sum(f.stat().st_size for f in files)


if __name__ == "__main__":
    main()
