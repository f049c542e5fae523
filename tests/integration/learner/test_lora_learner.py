"""learner.lora through the whole stack (the tiny model, the HF engine, Ray Train + DeepSpeed): only the adapter
trains, the KL reference is the base (the adapter off), and both syncs serve exactly what the learner computes: on
CPUs (sync=auto) the merged weights, and a run resumed with sync=adapter the base plus its checkpoint's adapter, then
the adapters it ships. The checkpoint holds the merged policy a server loads strictly and the adapter, which peft
loads back onto the base to the same weights. (The engines' side alone, and vLLM's:
tests/integration/serving/test_lora_serving.py.)"""

from __future__ import annotations

from helpers import small
import peft
import torch
from transformers import AutoModelForCausalLM

from lightning_ray.learner import lora
from lightning_ray.learner.digest import parameter_digest
from lightning_ray.models.tiny import EASY
from lightning_ray.trainer import train


def test_lora_serves_what_the_learner_computes_merged_then_as_an_adapter_after_a_resume(
        ray_cluster, tiny_model_path, serve_port, tmp_path):
    def run(iterations: int, sync: str = "auto", resume: str | None = None):
        return train(small({
            "run_dir": str(tmp_path), "model": {"path": str(tiny_model_path)}, "serve": {"port": serve_port},
            "task": {"generator": EASY, "eval_size": 4},
            # PPO: its value head gives every transition a signal, so each iteration updates; a KL loss to the base
            "algorithm": {"estimator": "ppo", "kl_coef": 0.5, "kl_penalty": "loss"},
            "trainer": {"iterations": iterations, "eval_every": 0, "checkpoint_every": 2},
            "learner": {"lr": 1e-2, "lora": {"rank": 4, "alpha": 8.0, "sync": sync}}, "resume": resume}))

    history = run(2)  # sync=auto: merged weights on CPUs
    first, second = history
    assert first["updated"] and second["updated"]
    # B starts at 0: the first step's policy is the base (no KL to it); the second's has moved away from it
    assert first["kl_ref"] == 0 and second["kl_ref"] > 0
    for i, h in enumerate(history):
        assert h["rollout_policy_versions"] == [i] and h["served_policy_version"] == h["policy_version"] == i + 1
    # iteration 1 was sampled from the served merged weights and scored by the learner's adapted policy: the same
    # numbers (serving the base, or stale weights, would be off by the update itself)
    assert second["logprob_abs_diff"] < 1e-4 and first["probe_logprob_after"] != first["probe_logprob_before"]
    checkpoint = tmp_path / "checkpoint"
    policy = AutoModelForCausalLM.from_pretrained(checkpoint)  # merged: the base's own names and shapes
    [digest] = set(second["worker_digests"])
    assert parameter_digest(policy) == digest
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
    moved = {k for k, t in policy.state_dict().items() if not torch.equal(t, base[k])}
    assert moved and all(k.endswith("proj.weight") for k in moved)  # the adapted linears only
    adapter = checkpoint.resolve().parent / "adapter"
    reloaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path), adapter)
    assert parameter_digest(lora.Merged(reloaded)) == digest
    assert sum(f.stat().st_size for f in adapter.iterdir()) < 0.2 * sum(
        f.stat().st_size for f in checkpoint.iterdir())

    # resumed with the adapter-only sync: iteration 2 sampled from the base plus the checkpoint's adapter, scored by
    # the learner restored from it; its update reaches the engine as an adapter
    third = run(3, sync="adapter", resume=str(tmp_path))[-1]
    assert third["updated"] and third["rollout_policy_versions"] == [2]
    assert third["served_policy_version"] == third["policy_version"] == 3
    assert third["logprob_abs_diff"] < 1e-4 and third["kl_ref"] > 0
