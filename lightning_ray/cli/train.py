"""The main job (`lightning-ray train`, jobs/train.py): Hydra's module name names its log, train.log."""

from __future__ import annotations

import atexit
import sys
from pathlib import Path

from lightning_ray.config import ConfigError, TrainConfig, job


def run_training(cfg: TrainConfig) -> None:
    """Evaluate, then iterations of rollouts → transitions → update → weight sync (the imitation job's too)."""
    from lightning_ray.learner.checkpoint import resume_point
    from lightning_ray.tasks import load_splits

    # before the loop's imports (~5 s): a resume= with no checkpoint, or nothing left to train, ends at once (a
    # ConfigError: one line, config.job), and a task setting its task refuses, before the services' minutes of start
    resume = resume_point(cfg)
    splits = load_splits(cfg.task)
    from lightning_ray.terminal import route_logs  # imported late: `--help` and config errors stay instant
    from lightning_ray.trainer import train
    from lightning_ray.trainer.collect import RolloutsFailed

    route_logs(cfg.run_path / "logs", cfg.verbose)
    try:
        history = train(cfg, resume, splits)
    except (Exception, KeyboardInterrupt) as e:  # hours of training need not be lost: say how to go on
        # at exit: below the traceback (Ray's OOM report is pages long); a refused start trained nothing (the
        # checkpoint there may be another run's, still running)
        if not isinstance(e, ConfigError) and (hint := resume_hint(cfg.run_path, e, auto=cfg.resume_auto)):
            atexit.register(print, hint, file=sys.stderr, flush=True)
        if isinstance(e, RolloutsFailed):  # what the agent or its endpoint said is the story, not where it was raised
            raise SystemExit(str(e)) from None
        raise
    board = f" (TensorBoard: tensorboard --logdir {cfg.run_path.parent})" if cfg.trainer.tensorboard else ""
    print(f"done: {len(history)} iterations, metrics in {cfg.run_path / 'metrics.jsonl'}{board}")


def resume_hint(run_path: Path, error: BaseException, auto: bool = False) -> str | None:
    """How a run that stopped goes on from its last checkpoint, if it wrote one; and when Ray's memory monitor
    killed its workers, that the node ran out of memory (Ray's own message is pages long). `auto`: the command
    already says resume=auto."""
    from lightning_ray.learner import checkpoint

    if (found := checkpoint.latest(run_path)) is None:
        return None
    causes = []
    while error is not None and len(causes) < 16:  # the chain: raise ... from ...
        causes.append(str(error))
        error = error.__cause__ or error.__context__
    oom = any("running low on memory" in c for c in causes)
    done = found.state.next_iteration
    return (f"the run stopped{': the node ran out of memory and Ray killed its workers' if oom else ''}. "
            f"Its checkpoint after {done} iteration{'s' * (done != 1)} goes on with the same command"
            f"{'' if auto else f' and resume={run_path}'}")


@job("train")
def main(cfg: TrainConfig) -> None:
    """Train the policy."""
    run_training(cfg)
