"""trainer.lora through the real learner (Ray Train + DeepSpeed, the tiny model): only the adapter trains, the KL
reference is the base (the adapter off), what is published and saved is the merged policy a server loads strictly,
and the checkpoint also holds the adapter, which peft loads back onto the base to the same weights."""

from __future__ import annotations

from helpers import random_transitions, small
import peft
import ray
from transformers import AutoModelForCausalLM

from lightning_ray.learner import lora
from lightning_ray.learner.driver import Learner
from lightning_ray.learner.worker import parameter_digest
from lightning_ray.weight_sync.registry import WeightRegistry


def test_lora_trains_the_adapter_and_publishes_the_merged_policy(ray_cluster, tiny_model_path, tmp_path):
    cfg = small({"run_dir": str(tmp_path), "algorithm": {"kl_coef": 0.5, "kl_penalty": "loss"}, "trainer": {
        "num_workers": 1, "threads_per_worker": 1, "lr": 1e-2, "micro_batch_tokens": 96, "max_logprob_gap": None,
        "lora": {"rank": 4, "alpha": 8.0}}})
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    base = {k: v.clone() for k, v in initial.state_dict().items()}
    registry = WeightRegistry.remote()
    learner = Learner(cfg, tiny_model_path, registry)
    try:
        first = learner.step(random_transitions(initial.config.vocab_size))[0]
        second = learner.step(random_transitions(initial.config.vocab_size))[0]
        version, refs = ray.get(registry.wait_newer.remote(1, 10.0))
        published = ray.get(refs[0])
        learner.save(tmp_path / "checkpoint")
    finally:
        learner.close()
    # B starts at 0: the first step's policy is the base (no KL to it); the second's has moved away from it
    assert first["kl_ref"] == 0 and second["kl_ref"] > 0 and first["grad_norm"] > 0
    assert version == 2 and set(published) == set(base)
    served = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    served.load_state_dict(published)  # strict: the base's own names and shapes
    assert parameter_digest(served) == second["digest"] != parameter_digest(initial)
    moved = {k for k in base if not (published[k] == base[k]).all()}
    assert moved and all(k.endswith("proj.weight") for k in moved)  # the adapted linears only
    checkpoint = tmp_path / "checkpoint"
    assert parameter_digest(AutoModelForCausalLM.from_pretrained(checkpoint / "policy")) == second["digest"]
    reloaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path),
                                              checkpoint / "adapter")
    assert parameter_digest(lora.Merged(reloaded)) == second["digest"]
    assert sum(f.stat().st_size for f in (checkpoint / "adapter").iterdir()) < 0.2 * sum(
        f.stat().st_size for f in (checkpoint / "policy").iterdir())
