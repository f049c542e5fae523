"""The main job: python jobs/train.py [key=value ...]  (Hydra overrides; see configs/train.yaml)."""

import logging
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from lightning_ray.config import ConfigError, validate


@hydra.main(version_base=None, config_path="../configs", config_name="train")
def main(raw: DictConfig) -> None:
    try:
        cfg = validate(OmegaConf.to_container(raw, resolve=True))
    except ConfigError as e:
        sys.exit(str(e))
    from lightning_ray.trainer import train  # imported late: `--help` and config errors stay instant

    for noisy in ("httpx", "httpx2"):  # one line per HTTP request drowns the per-iteration summary
        logging.getLogger(noisy).setLevel(logging.WARNING)

    history = train(cfg)
    print(f"done: {len(history)} iterations, metrics in {cfg.run_path / 'metrics.jsonl'}")


if __name__ == "__main__":
    main()
