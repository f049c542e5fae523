"""What the jobs (train.py, eval.py, serve.py here: Hydra entry points on configs/train.yaml, shared by jobs/*.py
and `lightning-ray train|eval|serve`) have in common. Each reads its overrides from the command line as Hydra does
(`key=value`, `--cfg job`, `hydra.run.dir=...`); `run(job, overrides)` runs one on the overrides given instead."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

CONFIGS = str(Path(__file__).resolve().parents[2] / "configs")  # the repository's (the package is installed editable)


def quiet_http() -> None:
    for noisy in ("httpx", "httpx2"):  # one line per HTTP request drowns the progress lines
        logging.getLogger(noisy).setLevel(logging.WARNING)


def run(job, overrides: list[str]) -> None:
    """Run a job's Hydra entry point on these overrides, as if they were its command line."""
    argv, sys.argv = sys.argv, [sys.argv[0], *overrides]
    try:
        job()
    finally:
        sys.argv = argv
