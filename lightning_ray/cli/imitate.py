"""Imitation, the warm start before RL (`lightning-ray imitate`, jobs/imitate.py): Hydra's module name names its
log, imitate.log."""

from __future__ import annotations

import shlex

from lightning_ray.cli.train import run_training
from lightning_ray.config import TrainConfig, job
from lightning_ray.config.secrets import masked

IMITATION_ONLY = ("teacher", "algorithm", "trainer", "seed", "run_dir", "resume", "model.path")


@job("imitate")
def main(cfg: TrainConfig) -> None:
    """The training loop with a teacher answering the training rollouts (configs/imitate.yaml): its episodes that
    reach algorithm.sft_min_reward are fine-tuned on; the checkpoint is where RL goes on from."""
    from hydra.core.hydra_config import HydraConfig

    run_training(cfg)
    print(f"go on with RL from it: {rl_command(cfg, list(HydraConfig.get().overrides.task))}")


def rl_command(cfg: TrainConfig, overrides: list[str]) -> str:
    """RL from the imitation's checkpoint, with this run's own settings (task, placement, model preset, engine,
    learner: a GPU run's go on on the GPUs) but those of imitation itself (teacher, algorithm, trainer, seed,
    run_dir). Both start from configs/train.yaml, so the overrides alone say it. A secret given in clear is printed as
    '***' (to be given again; serve.api_key=${oc.env:VAR} is printed as it is)."""
    def imitation_only(override: str) -> bool:
        key = override.lstrip("+~").split("=", 1)[0]
        return any(key == k or key.startswith(k + ".") for k in IMITATION_ONLY)

    kept = [masked(o) for o in overrides if not imitation_only(o)]  # printed: to the terminal and Ray's job logs
    return shlex.join(["python", "jobs/train.py", *kept, f"model.path={cfg.run_path / 'checkpoint'}"])
