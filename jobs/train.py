"""The main job: python jobs/train.py [key=value ...]  (Hydra overrides; see configs/train.yaml)."""

from lightning_ray.config import TrainConfig, job


@job("train")
def main(cfg: TrainConfig) -> None:
    from lightning_ray.terminal import route_logs  # imported late: `--help` and config errors stay instant
    from lightning_ray.trainer import train

    route_logs(cfg.run_path / "logs", cfg.verbose)
    history = train(cfg)
    print(f"done: {len(history)} iterations, metrics in {cfg.run_path / 'metrics.jsonl'}")


if __name__ == "__main__":
    main()
