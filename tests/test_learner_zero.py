"""Every ZeRO stage the config accepts trains, publishes whole weights a server can load, and saves a checkpoint that
loads back: two Ray Train ranks on the tiny model. (Stage 2 also runs in test_train_e2e, stage 0 in test_learning.)"""

from __future__ import annotations

import random

import pytest
import ray
from transformers import AutoModelForCausalLM

from lightning_ray.config import validate
from lightning_ray.training.learner import Learner
from lightning_ray.training.loop import parameter_digest
from lightning_ray.training.weights import WeightRegistry
from lightning_ray.types import Transition


def transitions(vocab: int, n: int = 8) -> list[Transition]:
    rng = random.Random(0)
    return [Transition(rollout_id=f"r{i}", group_id=f"g{i // 4}", span_id=f"s{i}",
                       prompt_ids=[rng.randrange(vocab) for _ in range(24)],
                       response_ids=[rng.randrange(vocab) for _ in range(8)], logprobs=[-1.0] * 8, reward=i % 2,
                       advantage=1.0 if i % 2 else -1.0, policy_version=0, temperature=1.0) for i in range(n)]


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_each_zero_stage_publishes_and_saves_whole_weights(ray_cluster, tiny_model_path, tmp_path, stage):
    cfg = validate({"run_dir": str(tmp_path), "trainer": {
        "num_workers": 2, "threads_per_worker": 1, "zero_stage": stage, "lr": 1e-3, "micro_batch_tokens": 96}})
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    registry = WeightRegistry.remote()
    learner = Learner(cfg, tiny_model_path, registry)
    try:
        replies = learner.step(transitions(initial.config.vocab_size))
        version, refs = ray.get(registry.wait_newer.remote(0, 10.0))
        published = ray.get(refs[0])  # while the rank that put it (its owner) lives
        learner.save(tmp_path / "checkpoint")
    finally:
        learner.close()
    assert all(r["grad_norm"] > 0 for r in replies)  # reported whatever the stage (DeepSpeed's own only under ZeRO)
    [digest] = {r["digest"] for r in replies}  # every rank holds the same weights ...
    assert digest != parameter_digest(initial)  # ... moved by the step
    served = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    served.load_state_dict(published)  # strict: every tensor whole, in the model's own shapes
    assert version == 1 and parameter_digest(served) == digest
    assert parameter_digest(AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint")) == digest
