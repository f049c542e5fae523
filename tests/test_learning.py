"""The whole loop learns: the tiny model's reward rises over a few iterations on an easy task (one-digit sums and
differences), on the real stack (Ray, Serve with the HF engine, the trace store, Ray Train + DeepSpeed)."""

from __future__ import annotations

from lightning_ray.config import validate
from lightning_ray.trainer import train

from lightning_ray.models.tiny import EASY  # sums and differences of two small numbers, as it was warmed up on


def test_reward_rises_over_a_few_iterations(ray_cluster, tiny_model_path, serve_port, tmp_path):
    cfg = validate({
        "run_dir": str(tmp_path),
        "model": {"path": str(tiny_model_path)},
        "serve": {"port": serve_port},
        "task": {"generator": EASY, "protocol": "text", "eval_size": 32},
        "rollout": {"tasks_per_iteration": 16, "group_size": 4, "agents_per_worker": 4, "max_tokens": 48},
        "algorithm": {"level": "trajectory"},
        "trainer": {"iterations": 6, "lr": 2e-3, "eval_every": 6, "checkpoint_every": 6},
    })
    history = train(cfg)
    rewards = [h["reward_mean"] for h in history]
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    assert last > first + 0.1, rewards
    before, after = history[0]["eval_before"]["accuracy"], history[-1]["eval"]["accuracy"]
    assert after > before, (before, after)
