"""The tiny model learns: over ten iterations of the whole loop (Serve, the HF engine, the trace store, Ray Train +
DeepSpeed with one rank, the weight sync) its reward rises on an easy task, sums and differences of two small
numbers in the text protocol. Sampled at temperature 1 it starts near 0.5; GRPO has a signal in most groups. The
same run with PPO (a value head and GAE instead of the group baseline) rises too (measured: 0.51 over the first
three iterations, 0.64 over the last three)."""

from __future__ import annotations

from statistics import mean

import pytest

from lightning_ray.config import validate
from lightning_ray.models.tiny import EASY
from lightning_ray.trainer import train


@pytest.fixture(scope="module", params=["grpo", "ppo"])
def history(request, ray_cluster, tiny_model_path, serve_port, tmp_path_factory):
    cfg = validate({
        "run_dir": str(tmp_path_factory.mktemp("learning")),
        "model": {"path": str(tiny_model_path)},
        "serve": {"port": serve_port},
        "task": {"generator": EASY},
        "algorithm": {"level": "trajectory", "estimator": request.param},
        # 64 groups per iteration: the reward's iteration-to-iteration noise (~0.03) stays well under the rise
        "rollout": {"tasks_per_iteration": 64, "group_size": 4, "agents_per_worker": 8},
        "trainer": {"iterations": 10, "lr": 1e-3, "eval_every": 0, "checkpoint_every": 10},
    })
    return train(cfg)


def test_reward_rises_over_a_few_iterations(history):
    rewards = [round(h["reward_mean"], 3) for h in history]
    assert all(h["updated"] for h in history), rewards
    # measured (lr 1e-3, two seeds): ~0.50 over the first three iterations, 0.57–0.62 over the last three; lr 2e-3
    # collapsed after its first step (0.57 → 0.15)
    assert mean(rewards[-3:]) > mean(rewards[:3]) + 0.04, rewards
