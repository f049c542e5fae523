"""What the CLI's job commands share: running a job's entry point (config.job) on the overrides given."""

from __future__ import annotations

import sys


def run(job, overrides: list[str]) -> None:
    """Run a job's Hydra entry point on these overrides, as if they were its command line."""
    argv, sys.argv = sys.argv, [sys.argv[0], *overrides]
    try:
        job()
    finally:
        sys.argv = argv
