"""The main job (`lightning-ray train`, jobs/train.py): Hydra's module name names its log, train.log."""

from __future__ import annotations

from lightning_ray.config import ConfigError, TrainConfig, job


def run_training(cfg: TrainConfig) -> None:
    """Evaluate, then iterations of rollouts → transitions → update → weight sync (the imitation job's too)."""
    from lightning_ray.terminal import route_logs  # imported late: `--help` and config errors stay instant
    from lightning_ray.trainer import train

    route_logs(cfg.run_path / "logs", cfg.verbose)
    try:
        history = train(cfg)
    except ConfigError as e:  # found once the run directory is read (resume=): the key named, no traceback
        raise SystemExit(str(e)) from None
    print(f"done: {len(history)} iterations, metrics in {cfg.run_path / 'metrics.jsonl'}")


@job("train")
def main(cfg: TrainConfig) -> None:
    """Train the policy."""
    run_training(cfg)
