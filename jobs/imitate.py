"""Imitation, the warm start before RL: python jobs/imitate.py [key=value ...]  (Hydra overrides; see
configs/imitate.yaml). The same as `lightning-ray imitate [key=value ...]` (lightning_ray/cli/imitate.py)."""

from lightning_ray.cli.imitate import main

if __name__ == "__main__":
    main()
