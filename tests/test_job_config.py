"""The main job's CLI rejects bad configuration by key, before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def run_job(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "jobs/train.py", *overrides], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("override, named", [
    ("rollout.group_size=0", "rollout.group_size"),
    ("algorithm.estimator=ppo2", "algorithm.estimator"),
    ("algorithm.credit=per_step", "algorithm.credit"),  # per-call advantages on the default trajectory level
    ("algorithm.kl_penalty=reward", "algorithm.kl_penalty"),  # token rewards without a critic to use them
    ("serve.port=99999", "serve.port"),
    ("task.agent=my_agent.py", "task.agent"),  # an entry point is module:function
])
def test_bad_values_name_the_key(override, named, tmp_path):
    r = run_job(override, f"hydra.run.dir={tmp_path}")
    assert r.returncode != 0
    assert named in r.stderr and "Traceback" not in r.stderr


def test_unknown_keys_are_rejected(tmp_path):
    r = run_job("trainer.learning_rate=1e-3", f"hydra.run.dir={tmp_path}")
    assert r.returncode != 0 and "learning_rate" in r.stderr


def test_no_secret_reaches_the_run_directory(tmp_path):
    """Hydra's own record of a run (.hydra/, with every override) would keep the API key in clear; the job's
    config.yaml keeps the resolved config with the key masked."""
    r = run_job("serve.api_key=sk-secret-1", "rollout.group_size=0", f"hydra.run.dir={tmp_path}")
    assert r.returncode != 0 and "rollout.group_size" in r.stderr
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and b"sk-secret-1" in p.read_bytes()]

    from lightning_ray.config import validate

    cfg = validate({"run_dir": str(tmp_path), "serve": {"api_key": "sk-secret-1"}, "trainer": {"lr": 3e-4}})
    cfg.save(tmp_path / "config.yaml")
    saved = (tmp_path / "config.yaml").read_text()
    assert "sk-secret-1" not in saved and "api_key: '***'" in saved
    assert validate(yaml.safe_load(saved)).trainer == cfg.trainer  # everything else as the run resolved it
