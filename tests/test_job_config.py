"""The main job's CLI rejects bad configuration by key, before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_job(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "jobs/train.py", *overrides], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("override, named", [
    ("rollout.group_size=0", "rollout.group_size"),
    ("algorithm.name=ppo2", "algorithm.name"),
    ("serve.port=99999", "serve.port"),
])
def test_bad_values_name_the_key(override, named, tmp_path):
    r = run_job(override, f"hydra.run.dir={tmp_path}")
    assert r.returncode != 0
    assert named in r.stderr and "Traceback" not in r.stderr


def test_unknown_keys_are_rejected(tmp_path):
    r = run_job("trainer.learning_rate=1e-3", f"hydra.run.dir={tmp_path}")
    assert r.returncode != 0 and "learning_rate" in r.stderr
