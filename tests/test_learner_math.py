"""The learner's scoring and gradient accumulation, on a small random Llama in one process (no Ray needed)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_ray.algorithm.grpo import policy_loss, token_weights
from lightning_ray.algorithm.lightningrl import merge_calls
from lightning_ray.training.learner import micro_batches
from lightning_ray.training.loop import collate, parameter_digest, score
from lightning_ray.types import Transition


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                        pad_token_id=0)).float()


def batch_of(n: int, seed: int = 0) -> list[Transition]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, r = rng.randint(3, 30), rng.randint(1, 12)
        out.append(Transition(rollout_id=f"r{i}", group_id="g", span_id=f"s{i}",
                              prompt_ids=[rng.randrange(1, 97) for _ in range(p)],
                              response_ids=[rng.randrange(1, 97) for _ in range(r)], logprobs=[-1.0] * r,
                              reward=1.0, advantage=rng.choice([-1.0, 0.5, 2.0]), policy_version=0,
                              temperature=rng.choice([0.7, 1.0])))
    return out


def test_score_is_the_tempered_softmax_of_the_full_forward_pass(model):
    transitions = batch_of(6)
    batch = collate([(t, 1.0) for t in transitions], pad_id=0)
    tempered, untempered, entropy, _ = score(model, batch)
    expected_t, expected_u, expected_h = [], [], []
    with torch.no_grad():
        for t in transitions:  # one unpadded row at a time, the whole vocabulary, the textbook way
            ids = torch.tensor([[*t.prompt_ids, *t.response_ids]], dtype=torch.long)
            logits = model(ids).logits[0, len(t.prompt_ids) - 1 : -1]
            target = torch.from_numpy(t.response_ids).long()[:, None]
            expected_t += torch.log_softmax(logits / t.temperature, -1).gather(-1, target).squeeze(-1).tolist()
            expected_u += torch.log_softmax(logits, -1).gather(-1, target).squeeze(-1).tolist()
            expected_h += torch.distributions.Categorical(logits=logits / t.temperature).entropy().tolist()
    assert torch.allclose(tempered.detach(), torch.tensor(expected_t), atol=1e-5)
    assert torch.allclose(untempered, torch.tensor(expected_u), atol=1e-5)
    assert torch.allclose(entropy, torch.tensor(expected_h), atol=1e-4)
    assert not entropy.requires_grad and score(model, batch, entropy_grad=True)[2].requires_grad


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "token_sum"])
def test_micro_batches_accumulate_the_gradient_of_the_whole_batch(model, aggregation):
    transitions = batch_of(9, seed=1)
    weighted = list(zip(transitions, token_weights(transitions, aggregation, max_tokens=12)))

    def gradient(token_budget: int) -> tuple[torch.Tensor, int]:
        model.zero_grad()
        packed = micro_batches(weighted, token_budget)
        for mb in packed:
            batch = collate(mb, pad_id=0)
            logprobs, *_ = score(model, batch)
            loss, _ = policy_loss(logprobs, logprobs.detach(), batch["advantages"], batch["weights"], 0.2)
            loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()]), len(packed)

    whole, one = gradient(10_000)
    split, many = gradient(64)
    assert one == 1 and many > 3
    assert torch.allclose(whole, split, atol=1e-6, rtol=1e-4)


def test_a_merged_episode_gets_the_gradient_of_its_separate_calls(model):
    """Trajectory level: one sequence with the tool result masked out scores each action exactly as the separate
    calls do (causal attention: the same context before each token), so the gradient is the same."""
    first = Transition(rollout_id="a", group_id="g", span_id="1", prompt_ids=[5, 6, 7], response_ids=[8, 9],
                       logprobs=[-1.0, -1.0], reward=1.0, advantage=1.0, policy_version=0)
    second = Transition(**{**first.model_dump(), "span_id": "2", "prompt_ids": [5, 6, 7, 8, 9, 40, 41],
                           "response_ids": [10], "logprobs": [-1.0]})
    merged, breaks = merge_calls([first, second])
    assert breaks == 0 and len(merged) == 1

    def gradient(transitions):
        model.zero_grad()
        batch = collate(list(zip(transitions, token_weights(transitions, "token_mean", 10))), pad_id=0)
        logprobs, *_ = score(model, batch)
        loss, _ = policy_loss(logprobs, logprobs.detach(), batch["advantages"], batch["weights"], 0.2)
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()]), logprobs.detach()

    (g_sep, lp_sep), (g_merged, lp_merged) = gradient([first, second]), gradient(merged)
    assert torch.allclose(lp_sep, lp_merged, atol=1e-5)
    assert torch.allclose(g_sep, g_merged, atol=1e-6, rtol=1e-4)


def test_activation_checkpointing_gives_the_same_gradient(model):
    """The GPU default (trainer.gradient_checkpointing: auto) recomputes activations in backward: same numbers."""
    transitions = batch_of(5, seed=2)
    batch = collate([(t, 1.0) for t in transitions], pad_id=0)

    def gradient() -> torch.Tensor:
        model.zero_grad()
        logprobs, *_ = score(model, batch)
        loss, _ = policy_loss(logprobs, logprobs.detach(), batch["advantages"], batch["weights"], 0.2)
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    plain = gradient()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    try:
        assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
        checkpointed = gradient()
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
    assert torch.allclose(plain, checkpointed, atol=1e-7, rtol=1e-5)


def test_the_parameter_digest_is_the_values_whatever_their_dtype_or_order(model):
    """Ranks, checkpoints and engines are compared by it: equal values, equal digests (bf16 weights held exactly in
    fp32 too); any changed value or swapped pair changes it."""
    bf16 = LlamaForCausalLM(model.config).to(torch.bfloat16)
    same = LlamaForCausalLM(model.config)
    same.load_state_dict({k: v.float() for k, v in bf16.state_dict().items()})
    assert parameter_digest(bf16) == parameter_digest(same)
    with torch.no_grad():
        w = same.model.layers[0].mlp.up_proj.weight
        w[0, 0], w[0, 1] = w[0, 1].clone(), w[0, 0].clone()  # a permutation keeps every plain sum
    assert parameter_digest(same) != parameter_digest(bf16)
