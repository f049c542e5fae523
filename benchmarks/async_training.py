"""Asynchronous vs synchronous training on the same work: the main job's configuration (SmolLM2's calc agent through
Serve + vLLM, Ray Train + DeepSpeed) run twice in one process, `rollout.mode=sync` then `async`, with the same
iterations, batch, seed and loss (truncated importance sampling on in both, so only the schedule differs).

    python benchmarks/async_training.py [key=value ...]     # Hydra overrides of configs/train.yaml, for both runs

Prints one JSON line per mode (wall-clock minutes, trained transitions per hour, how long the learner waited for
batches and how long no batch was collecting, as fractions of the loop's time, held-out accuracy before and after,
staleness) and one with the ratios async / sync. Not part of CI (~2 x 15 min on 2 cores with the defaults).
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path

from lightning_ray.config import compose
from lightning_ray.trainer import train

DEFAULTS = ["trainer.iterations=8", "trainer.eval_every=8", "task.eval_size=100", "algorithm.tis_cap=2"]


def run(mode: str, overrides: list[str], root: Path) -> dict:
    run_dir = root / "runs" / time.strftime(f"async-bench-{mode}-%Y-%m-%d_%H-%M-%S")
    cfg = compose([*DEFAULTS, *overrides, f"rollout.mode={mode}", f"run_dir={run_dir}"])
    start = time.perf_counter()
    history = train(cfg)
    wall = time.perf_counter() - start
    # the loop's own time: each iteration's record spans from its batch's wait to its log; phases overlap in async,
    # so the loop's time is the sum of what the learner waited and what it did (train, sync, eval, checkpoint)
    busy = sum(v for h in history for k, v in h["seconds"].items() if k not in ("rollout", "adapt", "wait"))
    learner_idle = sum(h["idle_seconds"]["learner"] for h in history)
    rollouts_idle = sum(h["idle_seconds"]["rollouts"] for h in history)
    loop = busy + learner_idle
    transitions = sum(h["transitions"] for h in history)
    evals = [h[k] for h in history for k in ("eval_before", "eval") if k in h]
    staleness = Counter()
    for h in history:
        staleness.update({int(k): v for k, v in h.get("staleness", {}).items()})
    return {"benchmark": "async_training", "mode": mode, "model": cfg.model.path, "engine": cfg.engine.kind,
            "iterations": len(history), "batch": f"{cfg.rollout.tasks_per_iteration}x{cfg.rollout.group_size}",
            "wall_minutes": round(wall / 60, 2), "loop_minutes": round(loop / 60, 2),
            "transitions": transitions, "transitions_per_hour": round(transitions / (loop / 3600)),
            "learner_idle_frac": round(learner_idle / loop, 3), "rollouts_idle_frac": round(rollouts_idle / loop, 3),
            "accuracy": [(e["after"], round(e["accuracy"], 3)) for e in evals],
            "reward_mean": [round(h["reward_mean"], 3) for h in history],
            "staleness": dict(sorted(staleness.items())), "stale_dropped": sum(h.get("stale_dropped", 0) for h in history),
            "run_dir": str(cfg.run_path)}


def main(overrides: list[str]) -> None:
    root = Path(__file__).resolve().parents[1]
    sync, asynchronous = (run(mode, overrides, root) for mode in ("sync", "async"))
    for result in (sync, asynchronous):
        print(json.dumps(result), flush=True)
    print(json.dumps({
        "benchmark": "async_training", "compare": "async / sync",
        "loop_time": round(asynchronous["loop_minutes"] / sync["loop_minutes"], 3),
        "transitions_per_hour": round(asynchronous["transitions_per_hour"] / sync["transitions_per_hour"], 3),
        "final_accuracy_diff": round(asynchronous["accuracy"][-1][1] - sync["accuracy"][-1][1], 3),
    }), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
