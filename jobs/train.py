"""The main job: python jobs/train.py [key=value ...]  (Hydra overrides; see configs/train.yaml)."""

import logging

from lightning_ray.config import TrainConfig, job


@job("train")
def main(cfg: TrainConfig) -> None:
    from lightning_ray.terminal import route_logs  # imported late: `--help` and config errors stay instant
    from lightning_ray.trainer import train

    for noisy in ("httpx", "httpx2"):  # one line per HTTP request drowns the per-iteration summary
        logging.getLogger(noisy).setLevel(logging.WARNING)
    route_logs(cfg.run_path / "logs", cfg.verbose)

    history = train(cfg)
    print(f"done: {len(history)} iterations, metrics in {cfg.run_path / 'metrics.jsonl'}")


if __name__ == "__main__":
    main()
