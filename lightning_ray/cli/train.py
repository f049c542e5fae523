"""The main job (`lightning-ray train`, jobs/train.py): Hydra's module name names its log, train.log."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from lightning_ray.cli.common import CONFIGS, quiet_http
from lightning_ray.config import from_hydra


@hydra.main(version_base=None, config_path=CONFIGS, config_name="train")
def main(raw: DictConfig) -> None:
    """Train the policy: evaluate, then iterations of rollouts → transitions → update → weight sync."""
    cfg = from_hydra(raw)
    from lightning_ray.trainer import train  # imported late: `--help` and config errors stay instant

    quiet_http()
    history = train(cfg)
    print(f"done: {len(history)} iterations, metrics in {cfg.run_path / 'metrics.jsonl'}")
