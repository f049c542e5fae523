"""Log the iteration: its record (record.py) kept in the run's history (before the checkpoint, which holds it), then
its line in metrics.jsonl and TensorBoard, its outcome on the Ray dashboard and its line on the terminal; the store
then keeps only the last `store.keep_iterations` iterations' spans."""

from __future__ import annotations

import json

from lightning_ray.metrics import metrics
from lightning_ray.trainer.board import to_board
from lightning_ray.trainer.collect import Batch
from lightning_ray.trainer.record import iteration_record, line, summary
from lightning_ray.trainer.run import Run
from lightning_ray.trainer.update import Update


def record_iteration(run: Run, batch: Batch, update: Update, idle: dict[str, float]) -> dict:
    i = batch.iteration
    record = iteration_record(i, batch.rollouts, batch.spans, batch.transitions, batch.adapted, batch.sampling,
                              run.learner.version, update.results, run.phase.seconds)  # seconds: filled till logged
    record["idle_seconds"] = idle
    if run.cfg.rollout.mode == "async":
        record.update({"staleness": dict(sorted(update.staleness.items())), "stale_dropped": update.stale_dropped})
    if update.probe_after:  # (none where the API did not answer the probe)
        record.update({"served_policy_version": update.probe_after["version"],
                       "probe_logprob_before": (update.probe_before or {}).get("logprob_mean"),
                       "probe_logprob_after": update.probe_after["logprob_mean"]})
    if i == 0 and run.evals and run.evals[0]["after"] == 0:  # (none where trainer.eval_before=false)
        record["eval_before"] = run.evals[0]
    if run.evals and run.evals[-1]["after"] == i + 1:
        record["eval"] = run.evals[-1]
    run.history.append(record)
    return record


def log(run: Run, record: dict) -> None:
    metrics().reward_mean.set(record["reward_mean"])
    if record["transitions"]:  # a Ray counter refuses 0 (every rollout failed, or no call was selected)
        metrics().transitions.inc(record["transitions"])
    metrics().policy_version.set(record["policy_version"], tags={"role": "trained"})
    written = line(record)
    with open(run.cfg.run_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps(written) + "\n")  # its fields are docs/01-training.md's table
    if run.board:
        to_board(run.board, written)
    print(summary(record), flush=True)
    i, keep = record["iteration"], run.cfg.store.keep_iterations
    if keep and i >= keep:  # the last `keep` iterations' spans stay
        run.services.store.delete_spans(before=run.started[i - keep + 1])
