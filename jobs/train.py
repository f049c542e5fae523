"""The main job: python jobs/train.py [key=value ...]  (Hydra overrides; see configs/train.yaml).
The same as `lightning-ray train [key=value ...]` (lightning_ray/cli/jobs.py)."""

from lightning_ray.cli.jobs import train

if __name__ == "__main__":
    train()
