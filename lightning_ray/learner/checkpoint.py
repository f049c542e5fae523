"""A run's checkpoints: everything `resume=<run_dir>` needs to go on as if the run had never stopped.

    <run_dir>/checkpoints/iter-000004/policy/   the policy as an HF model (what `model.path=` serves or trains from)
                                     learner/  DeepSpeed's own checkpoint: weights, optimizer state, a critic's value head
                                     state.json  the loop's state (LoopState)
    <run_dir>/checkpoint -> checkpoints/iter-000004/policy   the latest policy, by its old name

A checkpoint is written into `iter-N.tmp` and renamed into place only once whole, and the `checkpoint` link is swapped
atomically, so a crash while saving leaves the previous checkpoint as it was; a `.tmp` left behind is deleted by the
next save, whatever its iteration. The last `trainer.keep_checkpoints` are kept.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from pydantic import BaseModel

from lightning_ray.config import ConfigError, TrainConfig

DIR, LINK = "checkpoints", "checkpoint"


class LoopState(BaseModel):
    """Where the RL loop stands after an iteration (trainer/run.py)."""

    next_iteration: int  # the iteration a resumed run starts with
    policy_version: int  # the learner's version, the one the checkpoint's policy is served as
    rng_state: list  # the task sampler's random.Random state (as JSON: tuples become lists)
    evals: list[dict]  # held-out evaluations so far
    started: list[float]  # each iteration's start time (span retention cuts by it)
    history: list[dict]  # metrics.jsonl's lines so far: a resumed run rewrites the file from them

    def random_state(self) -> tuple:
        """rng_state as random.Random.setstate takes it."""
        version, internal, gauss = self.rng_state
        return version, tuple(internal), gauss


class Checkpoint(BaseModel):
    path: Path
    state: LoopState

    @property
    def policy(self) -> Path:
        return self.path / "policy"

    @property
    def learner(self) -> Path:
        return self.path / "learner"


def staging(run_path: Path, iteration: int) -> Path:
    """An empty directory to write iteration's checkpoint into (the learner's policy/ and learner/)."""
    tmp = run_path / DIR / f"iter-{iteration:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # a save that died half-way
    tmp.mkdir(parents=True)
    return tmp


def commit(tmp: Path, state: LoopState, keep: int) -> Checkpoint:
    """Make the staged checkpoint the run's latest: state.json, the rename, the `checkpoint` link; then delete all but
    the last `keep`."""
    (tmp / "state.json").write_text(state.model_dump_json())
    final = tmp.with_name(tmp.name.removesuffix(".tmp"))
    shutil.rmtree(final, ignore_errors=True)  # the same iteration saved before a crash: this one is newer
    tmp.rename(final)
    run_path = final.parents[1]
    link = run_path / f"{LINK}.tmp"
    link.unlink(missing_ok=True)
    link.symlink_to(final.relative_to(run_path) / "policy", target_is_directory=True)
    if (run_path / LINK).is_dir() and not (run_path / LINK).is_symlink():  # a run from before checkpoints/
        shutil.rmtree(run_path / LINK)
    os.replace(link, run_path / LINK)
    for old in _saved(run_path)[:-keep]:
        shutil.rmtree(old)
    for torn in (run_path / DIR).glob("iter-*.tmp"):  # a save that died, of another iteration (a resumed run's
        shutil.rmtree(torn, ignore_errors=True)  # schedule may differ): as big as a checkpoint
    return Checkpoint(path=final, state=state)


def latest(run_path: Path) -> Checkpoint | None:
    saved = _saved(run_path)
    if not saved:
        return None
    return Checkpoint(path=saved[-1], state=LoopState(**json.loads((saved[-1] / "state.json").read_text())))


def _saved(run_path: Path) -> list[Path]:
    """The whole checkpoints, oldest first."""
    return sorted(p for p in (run_path / DIR).glob("iter-*") if not p.name.endswith(".tmp")
                  and (p / "state.json").is_file())


def resume_point(cfg: TrainConfig) -> Checkpoint | None:
    """The checkpoint `resume=<run_dir>` goes on from: the run's latest (a run writes one every
    trainer.checkpoint_every iterations and after its last). `resume=auto`: run_dir's, if it has one (else None: a
    new run); one after the last iteration ends the job as done (a retried job that had finished training succeeds).
    Without resume, a run_dir holding checkpoints is refused."""
    if not cfg.resume:
        if _saved(cfg.run_path):  # a new run there would prune the other's checkpoints by name, and mix the records
            raise ConfigError(f"run_dir={cfg.run_path} holds a run's checkpoints: go on with resume={cfg.run_path} "
                              "(or resume=auto), or give the new run another run_dir")
        return None
    auto = cfg.resume_auto
    if (found := latest(cfg.run_path)) is None:
        if auto:
            print(f"resume=auto: no checkpoint in {cfg.run_path} yet: a new run", flush=True)
            return None
        raise ConfigError(f"resume={cfg.resume}: no checkpoint in {cfg.run_path / DIR} to go on from")
    if found.state.next_iteration >= cfg.trainer.iterations:
        done = (f"resume={cfg.resume}: the checkpoint in {cfg.run_path} is after iteration "
                f"{found.state.next_iteration}, the run's last (trainer.iterations={cfg.trainer.iterations}): "
                "nothing left to train")
        if auto:
            print(done, flush=True)
            raise SystemExit(0)
        raise ConfigError(done)
    return found
