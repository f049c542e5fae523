"""One whole iteration of the main job, phase by phase (rollout, adapt, train, sync, eval), per model: the tiny model
and, on a GPU, a Qwen2.5-0.5B-shaped one (random init, lightning_ray/models/shaped.py: no weights reach an offline
node). Its rollouts earn nothing, so it trains with PPO, whose critic gives every call an advantage: the update runs
at that model's size all the same.

    python benchmarks/iteration.py                                  # CPU: the tiny model
    python benchmarks/iteration.py --models tiny qwen2.5-0.5b       # one GPU (placement=colocated), both
    python benchmarks/iteration.py --models tiny engine=vllm        # key=value: Hydra overrides for every run

Prints a JSON line per iteration (its seconds per phase, the learner's split of its step, its peak memory) and one per
model with the phases summed over the iterations after the first (whose train phase holds the learner's warm-up).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

import torch

from lightning_ray.config import compose
from lightning_ray.models.shaped import QWEN2_5, shaped_model
from lightning_ray.trainer import train

DEVICE = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
RUN = ["experiment=calc_tiny", "rollout.tasks_per_iteration=16", "trainer.iterations=2", "trainer.eval_every=2",
       "trainer.eval_before=false", "task.eval_size=16"]
# a random-init model writes to max_tokens every time: 64 of them keep its rollouts to a few minutes on the HF engine
SHAPED = ["algorithm=ppo", "rollout.max_tokens=64"]


def run(model: str, overrides: list[str]) -> list[dict]:
    shaped = [f"model.path={shaped_model(model)}", *SHAPED] if model in QWEN2_5 else []
    placement = ["placement=colocated"] if torch.cuda.is_available() else []
    cfg = compose([*RUN, *placement, *shaped, *overrides, f"run_dir={tempfile.mkdtemp(prefix='iteration-bench-')}"])
    start = time.perf_counter()
    history = train(cfg)
    lines = [{"benchmark": "iteration", "model": model, "device": DEVICE, "engine": cfg.engine.kind,
              "weight_sync": cfg.learner.weight_sync, "iteration": r["iteration"], "updated": r["updated"],
              "transitions": r["transitions"], "trained_tokens": r.get("trained_tokens"), "seconds": r["seconds"],
              "learner_seconds": r.get("learner_seconds"), "learner_peak_mib": r.get("learner_peak_mib")}
             for r in history]
    later = history[1:] or history
    phases = {k: round(sum(r["seconds"].get(k, 0.0) for r in later), 2) for k in history[-1]["seconds"]}
    whole = sum(phases.values())
    lines.append({"benchmark": "iteration", "model": model, "device": DEVICE, "engine": cfg.engine.kind,
                  "iterations": len(later), "seconds": phases,
                  "share": {k: round(v / whole, 3) for k, v in phases.items()},
                  "wall_minutes": round((time.perf_counter() - start) / 60, 2)})
    return lines


def main(argv: list[str]) -> None:
    models = ["tiny"]
    if "--models" in argv:
        i = argv.index("--models")
        end = next((j for j in range(i + 1, len(argv)) if "=" in argv[j] or argv[j].startswith("--")), len(argv))
        models, argv = argv[i + 1:end], argv[:i] + argv[end:]
    if unknown := [m for m in models if m != "tiny" and m not in QWEN2_5]:
        raise SystemExit(f"--models: tiny or {', '.join(QWEN2_5)}, not {', '.join(unknown)}")
    for model in models:
        for line in run(model, argv):
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
