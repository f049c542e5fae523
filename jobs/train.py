"""The main job: python jobs/train.py [key=value ...]  (Hydra overrides; see configs/train.yaml).
The same as `lightning-ray train [key=value ...]` (lightning_ray/cli/train.py)."""

from lightning_ray.cli.train import main

if __name__ == "__main__":
    main()
