"""What the CLI's job commands share: running a job's entry point (config.job) on the overrides given, and the Hydra
callback that masks the secrets in Hydra's own records of a run."""

from __future__ import annotations

import atexit
import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from hydra.types import RunMode

from lightning_ray.config import mask_file


def run(job, overrides: list[str]) -> None:
    """Run a job's Hydra entry point on these overrides, as if they were its command line."""
    argv, sys.argv = sys.argv, [sys.argv[0], *overrides]
    try:
        job()
    finally:
        sys.argv = argv


class MaskSecrets(Callback):
    """Hydra writes its records of a run before the job starts, the command line in clear: a sweep's multirun.yaml,
    and .hydra/*.yaml where hydra.output_subdir is set. Each job masks them as it starts (config.masked, as in the
    run's config.yaml); a sweep's once more as the process exits, for a sweep whose first job never started."""

    def on_multirun_start(self, config, **kwargs) -> None:
        record = Path(config.hydra.sweep.dir) / "multirun.yaml"  # resolved once: ${now:...} stays the sweep's
        atexit.register(lambda: record.exists() and mask_file(record))

    def on_job_start(self, config, **kwargs) -> None:
        records = []
        if config.hydra.mode == RunMode.MULTIRUN:
            records.append(Path(config.hydra.sweep.dir) / "multirun.yaml")
        if config.hydra.output_subdir is not None:
            records += (Path(config.hydra.runtime.output_dir) / config.hydra.output_subdir).glob("*.yaml")
        for record in records:
            if record.exists():
                mask_file(record)
