"""Imitation, the warm start before RL (`lightning-ray imitate`, jobs/imitate.py): Hydra's module name names its
log, imitate.log."""

from __future__ import annotations

from lightning_ray.cli.train import run_training
from lightning_ray.config import TrainConfig, job


@job("imitate")
def main(cfg: TrainConfig) -> None:
    """The training loop with a teacher answering the training rollouts (configs/imitate.yaml): its episodes that
    reach algorithm.sft_min_reward are fine-tuned on; the checkpoint is where RL goes on from."""
    run_training(cfg)
    print(f"go on with RL from it: python jobs/train.py task={cfg.task.name} model.path={cfg.run_path / 'checkpoint'}")
