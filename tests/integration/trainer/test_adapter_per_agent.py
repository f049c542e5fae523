"""An adapter per agent (algorithm.adapters) through the whole stack: the tiny model, the HF engine, rollout
workers running a two-agent workflow (tests/agents/two_agents.py), Ray Train + DeepSpeed (two ZeRO-2 ranks). Each
agent's calls are served with its own adapter (chosen from the header the platform's propagator adds, or from the
model name a call gives), recorded with it, and trained on it; the next iteration's calls are sampled from exactly
what the learner computes for each (ranks running different adapters side by side would miss it: 3.5e-4); the
checkpoint holds both adapters, apart, on the untouched base, and serves them again (model.adapter)."""

from __future__ import annotations

import peft
import pytest
import torch
from helpers import served_adapters, small
from transformers import AutoModelForCausalLM

from lightning_ray.models.tiny import EASY
from lightning_ray.services import Services
from lightning_ray.trainer import train
from lightning_ray.trainer.update import probe


def config(run_dir, model: dict, serve_port: int):
    return small({
        "run_dir": str(run_dir), "model": model, "serve": {"port": serve_port},
        "task": {"agent": "tests.agents.two_agents:agent", "generator": EASY, "eval_size": 4},
        # PPO: its value head gives every transition a signal, so each iteration updates both adapters
        "algorithm": {"estimator": "ppo", "adapters": {"draft": ["drafter"], "solve": ["solver"]}},
        "trainer": {"iterations": 2, "eval_every": 0, "checkpoint_every": 2},
        # two ZeRO-2 ranks with small micro-batches: at each micro-batch every rank runs the same adapter (ZeRO-2
        # reduces each gradient as backward makes it)
        "learner": {"lr": 1e-2, "lora": {"rank": 4, "alpha": 8.0}, "num_workers": 2, "threads_per_worker": 1,
                    "zero_stage": 2, "micro_batch_tokens": 256}})


def test_each_agent_is_served_and_trained_with_its_own_adapter(ray_cluster, tiny_model_path, serve_port, tmp_path):
    history = train(config(tmp_path, {"path": str(tiny_model_path)}, serve_port))

    # every call with its agent's adapter: the drafter's by the header, the solver's (no agent span) by its model name
    assert served_adapters(tmp_path) == {("drafter", "draft"), (None, "solve")}

    for i, h in enumerate(history):
        assert h["updated"] and h["served_policy_version"] == h["policy_version"] == i + 1
        assert h["base_calls"] == 0 and set(h["adapters"]) == {"draft", "solve"}
        assert h["micro_batches"] > 4 and len(set(h["worker_digests"])) == 1  # the ranks stepped alike
        assert all(a["transitions"] > 0 for a in h["adapters"].values())
    # iteration 1's calls were sampled by each agent's updated adapter and scored by the learner with the same one:
    # an engine serving one agent's calls with the other's adapter, or with the base, would be off by an update
    assert history[1]["logprob_abs_diff"] < 1e-4
    assert history[0]["probe_logprob_after"] != history[0]["probe_logprob_before"]  # the probe: `policy/draft`

    checkpoint = (tmp_path / "checkpoint").resolve().parent
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    policy = AutoModelForCausalLM.from_pretrained(checkpoint / "policy")  # the base, as it was
    assert all(torch.equal(t, base.state_dict()[k]) for k, t in policy.state_dict().items())
    adapted = {}
    for name in ("draft", "solve"):
        model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path),
                                               checkpoint / "adapter" / name)
        adapted[name] = {k.replace(f".{name}.", "."): p for k, p in model.named_parameters() if "lora_B" in k}
        assert any(p.abs().sum() > 0 for p in adapted[name].values())  # trained: B left zero
    assert any(not torch.equal(adapted["draft"][k], adapted["solve"][k]) for k in adapted["draft"])

    # the checkpoint's adapters served again on the base (model.adapter: what jobs/eval.py takes) are the policy the
    # run ended with: the probe (`policy/draft`) reads the same logprobs as after the last sync
    cfg = config(tmp_path / "served", {"path": str(tiny_model_path), "adapter": str(checkpoint / "adapter")},
                 serve_port)
    with Services(cfg, rollout_workers=False) as services:
        assert probe(services.server_url, cfg)["logprob_mean"] == pytest.approx(history[-1]["probe_logprob_after"],
                                                                             abs=1e-5)
