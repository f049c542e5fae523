"""Does an agent measurably improve? The whole platform (Serve + vLLM, the trace store, Ray Train + DeepSpeed, the
weight sync) trains SmolLM2-135M-Instruct on reasoning-gym basic_arithmetic with the calculator agent, and held-out
accuracy (greedy, fixed seed, ≥ 100 problems) is measured before, during and after.

    python benchmarks/learning.py [key=value ...]     # Hydra overrides of configs/train.yaml

Defaults: the main job's configuration with 16 iterations and an evaluation every 4. Not part of CI (~45 min on
2 cores). Prints one JSON line (accuracy curve, iterations, wall-clock minutes, seconds per phase) and writes
metrics.jsonl, learning_curve.png and learning.json in the run directory (runs/learning-<time>/).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from lightning_ray.config import TrainConfig, compose
from lightning_ray.tasks import dataset_of
from lightning_ray.trainer import train

DEFAULTS = ["trainer.iterations=16", "trainer.eval_every=4", "task.eval_size=100"]


def main(overrides: list[str]) -> None:
    root = Path(__file__).resolve().parents[1]
    run_dir = root / "runs" / time.strftime("learning-%Y-%m-%d_%H-%M-%S")
    cfg = compose([*DEFAULTS, *overrides, f"run_dir={run_dir}"])
    result = {"benchmark": "learning", **trained(cfg)}
    (cfg.run_path / "learning.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result), flush=True)


def trained(cfg: TrainConfig) -> dict:
    """Train with the config; what it measured: held-out accuracy after each evaluation, reward per iteration, wall
    minutes and seconds by phase."""
    start = time.perf_counter()
    history = train(cfg)
    minutes = (time.perf_counter() - start) / 60
    evals = [h[k] for h in history for k in ("eval_before", "eval") if k in h]
    phases: dict[str, float] = {}
    for h in history:
        for k, v in h["seconds"].items():
            phases[k] = round(phases.get(k, 0.0) + v, 1)
    return {"model": cfg.model.path, "dataset": dataset_of(cfg.task), "protocol": cfg.task.protocol,
            "held_out": cfg.task.eval_size, "iterations": len(history),
            "batch": f"{cfg.rollout.tasks_per_iteration}x{cfg.rollout.group_size}", "lr": cfg.learner.lr,
            "accuracy": [(e["after"], round(e["accuracy"], 3)) for e in evals],
            **({"accuracy_by": evals[-1]["accuracy_by"]} if "accuracy_by" in evals[-1] else {}),  # the last's
            "reward_mean": [round(h["reward_mean"], 3) for h in history],
            "wall_minutes": round(minutes, 1), "seconds_by_phase": phases,
            "png": str(cfg.run_path / "learning_curve.png")}


if __name__ == "__main__":
    main(sys.argv[1:])
