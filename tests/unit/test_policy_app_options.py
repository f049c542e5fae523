"""The policy app's Serve limits come from the config (serve.max_ongoing_requests, serve.max_queued_requests), and a
bad one is refused naming its key: checked on the bound app, nothing started."""

from __future__ import annotations

import pytest

from lightning_ray.config import ConfigError, compose
from lightning_ray.serving.app import policy_app


def deployment(overrides: list[str], tmp_path):
    cfg = compose([f"run_dir={tmp_path}", "engine=hf", *overrides])
    return policy_app(cfg, "model", None, None)._bound_deployment


def test_serve_limits_reach_each_replica(tmp_path):
    default = deployment([], tmp_path)
    assert (default.max_ongoing_requests, default.max_queued_requests) == (256, -1)
    set_ = deployment(["serve.max_ongoing_requests=64", "serve.max_queued_requests=1000"], tmp_path)
    assert (set_.max_ongoing_requests, set_.max_queued_requests) == (64, 1000)


@pytest.mark.parametrize("overrides, limit", [
    (["rollout.num_workers=4", "rollout.agents_per_worker=250"], 1000),  # every agent fits one replica
    (["rollout.num_workers=4", "rollout.agents_per_worker=250", "serve.max_ongoing_requests=300"], 300),
    (["rollout.num_workers=1", "rollout.agents_per_worker=8"], 256),  # room for agents outside the run
])
def test_the_default_limit_takes_every_agent_of_the_run(overrides, limit, tmp_path):
    """Calls a replica cannot take wait in Serve's proxy while its router polls for room: with 1,000 agents
    against a limit of 256 the rollouts ran 2.3x slower and 1% timed out (benchmarks/many_agents.py)."""
    assert deployment(overrides, tmp_path).max_ongoing_requests == limit


@pytest.mark.parametrize("override", ["serve.max_ongoing_requests=0", "serve.max_queued_requests=-2"])
def test_a_bad_limit_names_its_key(override, tmp_path):
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        compose([f"run_dir={tmp_path}", override])
