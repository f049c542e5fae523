"""python -m lightning_ray.cli: the same as the `lightning-ray` command."""

import sys

from lightning_ray.cli.app import main

sys.exit(main())
