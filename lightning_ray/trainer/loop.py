"""The LightningRL training loop, top to bottom: collect a batch (tasks → rollouts by the unmodified agent → spans →
transitions) → update the policy (GRPO, PPO, ...; new weights on every serve replica) → evaluate on held-out tasks →
log; a step each, in its own module here. schedule.py says when a batch is collected: before its update (sync) or
while the updates before it train (async)."""

from __future__ import annotations

import json
from types import EllipsisType

from lightning_ray.config import TrainConfig
from lightning_ray.learner import checkpoint
from lightning_ray.report import plot_learning_curve
from lightning_ray.services import Services
from lightning_ray.tasks import dataset_of, load_splits
from lightning_ray.trainer.evaluate import evaluate_held_out, failures
from lightning_ray.trainer.log import log, record_iteration
from lightning_ray.trainer.record import line
from lightning_ray.trainer.run import Run
from lightning_ray.trainer.schedule import Batches
from lightning_ray.types import Task
from lightning_ray.trainer.update import save_checkpoint, update


def train(cfg: TrainConfig, resume: checkpoint.Checkpoint | None | EllipsisType = ...,
          splits: tuple[list[Task], list[Task]] | None = None) -> list[dict]:
    """`resume`: the checkpoint to go on from, as checkpoint.resume_point(cfg) found it (found here if not given);
    `splits`: the training and held-out tasks (made here if not given), before any service starts."""
    if resume is ...:
        resume = checkpoint.resume_point(cfg)
    splits = splits or load_splits(cfg.task)  # a task setting its task refuses, before any service starts
    with Services(cfg, learner=True, resume=resume) as services:
        run = Run(cfg, services, resume, splits)
        # metrics.jsonl as the checkpoint's history has it, later lines gone; a new run's empty (a retried job's
        # first attempt, stopped before its first checkpoint, left its lines: they were counted twice)
        (cfg.run_path / "metrics.jsonl").write_text("".join(json.dumps(line(r)) + "\n" for r in run.history))
        if resume:
            print(f"resumed from {resume.path.name}: iteration {run.first}, "
                  f"policy v{resume.state.policy_version}", flush=True)
        elif cfg.trainer.eval_every and cfg.trainer.eval_before:
            before = evaluate_held_out(run, 0)
            print(f"held-out accuracy before training: {before['accuracy']:.3f}{failures(before)}", flush=True)
        run.start_clock()
        with Batches(run) as batches:
            for iteration in run.iterations():
                batch = batches.take(iteration)
                if not (last := run.ends_at(iteration)):
                    batches.start_after(iteration)  # async: the next batches' rollouts run while this one trains
                updated = update(run, batch)
                if not last and (last := run.ends_at(iteration)):  # the time budget spent meanwhile: none after this
                    batches.cancel_ahead()  # nor their rollouts beside the last evaluation
                if run.evaluates_at(iteration, last):
                    evaluate_held_out(run, iteration + 1)
                record = record_iteration(run, batch, updated, batches.idle_seconds())
                if run.checkpoints_at(iteration, last):
                    save_checkpoint(run, iteration)
                log(run, record)
                if last:
                    break
        finish(run)
    return run.history


def finish(run: Run) -> None:
    """The learning curve beside metrics.jsonl, and the held-out accuracy before and after on the terminal."""
    if run.board:
        run.board.close()
    if run.history:
        title = f"{dataset_of(run.cfg.task)} · {run.cfg.model.path or 'tiny test model'}"
        plot_learning_curve(run.history, run.evals, run.cfg.run_path / "learning_curve.png", title)
    if run.evals and (final := run.evals[-1])["after"]:
        first = run.evals[0]  # none before training where trainer.eval_before=false
        before = f"{first['accuracy']:.3f} before → " if first["after"] == 0 else ""
        print(f"held-out accuracy: {before}{final['accuracy']:.3f} after {final['after']} iterations "
              f"({len(run.held_out)} problems){failures(final)}", flush=True)
