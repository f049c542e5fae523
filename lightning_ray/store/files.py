"""A run's store read straight from its SQLite files, without Ray: what `lightning-ray store inspect|export` show.

The files are the store's own (traces.sqlite, or traces-<i>.sqlite per shard, each with its -spans file beside it),
opened through the same backend that wrote them, so spans decode as the trainer reads them (packed token ids
included). Transitions are made from the spans as training makes them (LightningRL, with the run's config.yaml),
before credit assignment."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import yaml

from lightning_ray.algorithm.lightningrl import adapt
from lightning_ray.algorithm.select import Selection
from lightning_ray.config import TrainConfig, as_recorded_today, validate
from lightning_ray.store.sqlite import SQLiteBackend
from lightning_ray.types import FINISHED, Rollout, Span

_BATCH = 200  # rollouts read at a time: a run's spans need not fit in memory at once


class NoStore(FileNotFoundError):
    """The directory is not a run directory with a store in it."""


def shard_files(run_dir: Path) -> list[Path]:
    files = sorted(p for p in run_dir.glob("traces*.sqlite") if not p.stem.endswith("-spans"))
    if not run_dir.is_dir() or not files:
        raise NoStore(f"{run_dir}: not a run directory (no traces.sqlite in it)")
    return files


def run_config(run_dir: Path) -> TrainConfig:
    """The config the run recorded (config.yaml); the defaults where it has none."""
    path = run_dir / "config.yaml"
    return validate(as_recorded_today(yaml.safe_load(path.read_text())) if path.exists() else {"run_dir": str(run_dir)})


def records(run_dir: Path, what: str) -> Iterator[dict]:
    """Every rollout, span or transition of the run as a JSON-ready dict, rollouts in the order they were queued."""
    transitions = _adapter(run_config(run_dir))
    for rollouts, spans in _batches(run_dir, with_spans=what != "rollouts"):
        items = {"rollouts": rollouts, "spans": spans}.get(what) or transitions(rollouts, spans)[0]
        yield from (item.model_dump(mode="json") for item in items)


def summary(run_dir: Path) -> dict:
    """Rollouts by status, their rewards, spans by name, policy calls and transitions, iterations."""
    transitions = _adapter(run_config(run_dir))
    statuses, span_names, adapted, rewards, groups, made = Counter(), Counter(), Counter(), [], set(), 0
    for rollouts, spans in _batches(run_dir):
        statuses.update(r.status for r in rollouts)
        span_names.update(s.name for s in spans)
        batch, counts = transitions(rollouts, spans)
        made += len(batch)
        adapted.update(counts)
        rewards += [r.reward for r in rollouts if r.reward is not None]
        groups.update(r.task.group_id for r in rollouts if r.task.group_id)
    return {
        "run_dir": str(run_dir),
        "rollouts": sum(statuses.values()),
        "rollouts_by_status": dict(statuses.most_common()),
        "rewards": {"scored": len(rewards), "mean": sum(rewards) / len(rewards) if rewards else None,
                    "min": min(rewards, default=None), "max": max(rewards, default=None)},
        "spans": sum(span_names.values()),
        "spans_by_name": dict(span_names.most_common()),
        "policy_calls": adapted["policy_calls"],
        "transitions": made,
        # training rollouts are grouped as task@iteration; held-out evaluation's have no group
        "iterations": len({g.rpartition("@")[2] for g in groups if "@" in g}),
    }


def _batches(run_dir: Path, with_spans: bool = True) -> Iterator[tuple[list[Rollout], list[Span]]]:
    """The rollouts of every shard, a batch at a time, with their spans; then the spans of no rollout."""
    for db in map(SQLiteBackend, shard_files(run_dir)):
        rollouts = db.query_rollouts()
        for start in range(0, len(rollouts), _BATCH):
            batch = rollouts[start:start + _BATCH]
            yield batch, db.query_spans([r.rollout_id for r in batch]) if with_spans else []
        if with_spans:
            yield [], db.query_spans_outside_rollouts()


def _adapter(cfg: TrainConfig):
    """(rollouts, spans) -> (transitions, counts), as the run's training made them from its ended training rollouts:
    held-out evaluation's (no group) are left out, or SFT on an export would learn the held-out problems."""
    select = Selection.of(cfg.model.name, cfg.algorithm.select.models, cfg.algorithm.select.agents)
    return lambda rollouts, spans: adapt([r for r in rollouts if r.status in FINISHED and r.task.group_id], spans,
                                         cfg.model.name, cfg.algorithm.level, cfg.task.agent_rewards, select,
                                         imitation=cfg.algorithm.objective == "sft")
