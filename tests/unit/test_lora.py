"""LoRA's pieces on a small random Llama (no Ray): the merged view is the adapted policy as one plain model under
the base's own names, and the adapter switched off is the base, bit for bit. The learner training with them:
tests/integration/learner/test_lora_learner.py."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_ray.config import ConfigError, LearnerConfig, LoraConfig, compose
from lightning_ray.learner import lora
from lightning_ray.learner.digest import parameter_digest
from lightning_ray.learner.worker import trainable_policy
from lightning_ray.weight_sync.adapter import DEFAULT


@pytest.fixture
def base() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)).eval()


def adapted(base: LlamaForCausalLM, **options) -> torch.nn.Module:
    """The base with an adapter whose B is no longer zero (as after some training)."""
    names = dict(base.state_dict())
    model = lora.with_adapter(base, LoraConfig(**options))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    assert set(names) == {k.replace(".base_layer", "") for k in model.get_base_model().state_dict()
                          if ".lora_" not in k}
    return model


def test_the_merged_view_is_the_adapted_policy_as_a_plain_model(base):
    names = set(base.state_dict())
    reference = {k: v.clone() for k, v in base.state_dict().items()}
    model = adapted(base, rank=4, alpha=8.0)
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        adapted_logits = model(input_ids=ids).logits
        merged = lora.Merged(model).state_dict()
        assert set(merged) == names  # the base's names: what an engine loads, strictly
        plain = LlamaForCausalLM(base.config).eval()
        plain.load_state_dict(merged)
        torch.testing.assert_close(plain(input_ids=ids).logits, adapted_logits, rtol=1e-5, atol=1e-5)
        # only the adapted layers moved; embeddings and norms are the base's, and the base itself is untouched
        moved = {k for k in names if not torch.equal(merged[k], reference[k])}
        assert moved and all(k.endswith("proj.weight") for k in moved)
        assert all(torch.equal(v, reference[k.replace(".base_layer", "")])
                   for k, v in model.get_base_model().state_dict().items() if ".lora_" not in k)
        # parameters as the weight publishers read them: each once (the tied LM head is the embeddings)
        assert dict(lora.Merged(model).named_parameters()).keys() == dict(plain.named_parameters()).keys()


def test_the_adapter_switched_off_is_the_base(base):
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        expected = base(input_ids=ids).logits
        model = adapted(base, rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
        assert not torch.equal(model(input_ids=ids).logits, expected)
        assert torch.equal(lora.AdapterOff(model)(input_ids=ids).logits, expected)
        assert lora.AdapterOff(model).get_decoder() is model.get_decoder()
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        n for n, _ in model.named_parameters() if ".lora_" in n and ("q_proj" in n or "v_proj" in n)]


def test_every_adapter_stays_trainable_after_a_pass_with_the_adapters_off(base):
    """peft re-enables adapters with the active one alone trainable; with an adapter per agent the others must stay
    trainable (a checkpoint saves the trainable weights: an adapter frozen by the KL reference's pass went missing)."""
    model = lora.with_adapter(base, LoraConfig(rank=4), ("writer", "rewriter"))
    lora.use_adapter(model, "rewriter")
    with torch.no_grad():
        lora.AdapterOff(model)(input_ids=torch.randint(0, 64, (1, 8)))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {n for n, _ in model.named_parameters() if ".lora_" in n}
    assert any(".writer." in n for n in trained) and any(".rewriter." in n for n in trained)


def test_lora_is_off_by_default_and_its_settings_are_checked():
    assert compose([]).learner.lora is None
    assert compose(["learner.lora={}"]).learner.lora == LoraConfig()
    assert compose(["learner.lora={rank:4,target_modules:[q_proj]}"]).learner.lora.target_modules == ["q_proj"]
    with pytest.raises(ConfigError, match=r"learner\.lora\.rank"):
        compose(["learner.lora={rank:0}"])


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"]])
def test_adapters_on_the_top_layers_leave_the_layers_below_out_of_the_backward(base, targets):
    """learner.lora.layers=1 of 2: every adapted linear of the top layer, none of the bottom one, whose activations
    then need no gradient (the backward stops above it: why an update costs less); the merged view still the
    adapted policy."""
    model = adapted(base, rank=4, alpha=8.0, target_modules=targets, layers=1)
    trained = {n.split(".lora_")[0] for n, p in model.named_parameters() if p.requires_grad}
    every = {n.split(".lora_")[0] for n, _ in adapted(LlamaForCausalLM(base.config), target_modules=targets)
             .named_parameters() if ".lora_" in n}
    assert trained == {n for n in every if ".layers.1." in n} and len(trained) == len(every) / 2
    needs_grad = []
    for layer in model.get_base_model().model.layers:
        layer.register_forward_hook(lambda module, inputs, out: needs_grad.append(out[0].requires_grad))
    ids = torch.randint(0, 64, (2, 12))
    logits = model(input_ids=ids).logits
    assert needs_grad == [False, True]
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    with torch.no_grad():
        plain = LlamaForCausalLM(base.config).eval()
        plain.load_state_dict(lora.Merged(model).state_dict())
        torch.testing.assert_close(plain(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"learner\.lora\.layers=3: the model has 2 layers"):
        lora.with_adapter(LlamaForCausalLM(base.config), LoraConfig(layers=3))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_learners_policy_runs_no_backward_below_its_lowest_adapted_layer(base, checkpointing):
    """learner.lora.layers=1 of 2 as the learner sets its policy up (worker.trainable_policy), also with activation
    checkpointing (the GPU default): the bottom layer's output needs no gradient — the hook transformers puts on the
    embeddings for reentrant checkpointing would make it need one — and the top layer's adapters get theirs."""
    t = LearnerConfig(lora=LoraConfig(rank=4, layers=1), gradient_checkpointing=checkpointing)
    model = trainable_policy(base, t, [DEFAULT])
    assert model.training and model.is_gradient_checkpointing == checkpointing
    needs_grad = []
    for layer in model.get_base_model().model.layers:
        layer.register_forward_hook(lambda module, inputs, out: needs_grad.append(out[0].requires_grad))
    model(input_ids=torch.randint(0, 64, (2, 12))).logits.sum().backward()
    assert needs_grad[:2] == [False, True]  # checkpointing runs the top layer again in the backward
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_a_digest_of_the_merged_view_keeps_no_merged_weight(base):
    """The learner's ranks digest the merged policy after every step: one merged weight at a time, none kept (a
    large model's merged copy would be its linear layers again in the GPU's memory); the digest is the plain
    model's with those weights, and a save's or a publish's whole view the same."""
    view = lora.Merged(adapted(base))
    digest = parameter_digest(view)
    assert "weights" not in vars(view)
    plain = LlamaForCausalLM(base.config)
    plain.load_state_dict(view.state_dict())
    assert parameter_digest(plain) == digest == parameter_digest(view)
