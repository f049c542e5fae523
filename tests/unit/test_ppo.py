"""PPO's critic side and truncated importance sampling, by hand: token rewards, GAE, whitening, the value loss, and
the learner's value head on a small random Llama in one process (no Ray needed)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_ray.algorithm.advantages import compute_advantages, has_signal
from lightning_ray.algorithm.loss import policy_loss, truncated_is_weights
from lightning_ray.algorithm.ppo import gae, token_rewards, value_loss, whiten
from lightning_ray.config import AlgorithmConfig
from lightning_ray.learner.scoring import WithValueHead, collate, policy_of, score
from lightning_ray.learner.worker import critic_advantages
from lightning_ray.types import Transition

PPO = AlgorithmConfig(estimator="ppo", gae_lambda=1.0)


def test_gae_by_hand():
    rewards, values = torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.5, 0.25, 0.5])
    # λ = 0.5: δ = [0 + 0.25 − 0.5, 0 + 0.5 − 0.25, 1 + 0 − 0.5] = [−0.25, 0.25, 0.5]; A_2 = 0.5,
    # A_1 = 0.25 + 0.5 · 0.5 = 0.5, A_0 = −0.25 + 0.5 · 0.5 = 0; targets A + V
    advantages, targets = gae(rewards, values, lam=0.5)
    assert advantages.tolist() == pytest.approx([0.0, 0.5, 0.5])
    assert targets.tolist() == pytest.approx([0.5, 0.75, 1.0])
    # λ = 1: Monte Carlo, A_k = (rewards from k on) − V_k and every target is the return; λ = 0: one-step TD
    assert gae(rewards, values, lam=1.0)[0].tolist() == pytest.approx([0.5, 0.75, 0.5])
    assert gae(rewards, values, lam=1.0)[1].tolist() == pytest.approx([1.0, 1.0, 1.0])
    assert gae(rewards, values, lam=0.0)[0].tolist() == pytest.approx([-0.25, 0.25, 0.5])


def test_token_rewards_put_the_return_last_and_the_kl_penalty_everywhere():
    assert token_rewards(1.0, 3).tolist() == [0.0, 0.0, 1.0]
    penalized = token_rewards(1.0, 3, kl=torch.tensor([0.1, 0.2, 0.3]), kl_coef=0.5)
    assert penalized.tolist() == pytest.approx([-0.05, -0.1, 0.85])
    assert token_rewards(1.0, 0).tolist() == []


def test_whiten_and_value_loss_by_hand():
    assert whiten(torch.tensor([1.0, 2.0, 3.0])).tolist() == pytest.approx([-1.224745, 0.0, 1.224745], abs=1e-5)
    loss = value_loss(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0]), torch.tensor([0.5, 0.25]))
    assert loss.item() == pytest.approx(0.5 * (1 * 0.5 + 4 * 0.25))


def test_truncated_importance_weights_reweigh_the_surrogate():
    learner, sampler = torch.log(torch.tensor([0.5, 0.2, 0.9])), torch.log(torch.tensor([0.25, 0.4, 0.1]))
    weights = truncated_is_weights(learner, sampler, cap=2.0)  # ratios 2, 0.5, 9 → capped at 2
    assert weights.tolist() == pytest.approx([2.0, 0.5, 2.0]) and not weights.requires_grad
    logprobs = torch.zeros(2, requires_grad=True)
    loss, _ = policy_loss(logprobs, logprobs.detach(), torch.tensor([1.0, 1.0]), torch.ones(2), 0.2,
                          is_weights=torch.tensor([2.0, 0.5]))
    loss.backward()
    assert loss.item() == pytest.approx(-2.5) and logprobs.grad.tolist() == pytest.approx([-2.0, -0.5])


def test_ppo_estimator_leaves_the_baseline_to_the_critic():
    ts = [Transition(rollout_id=r, group_id="g", span_id=r, prompt_ids=[1], response_ids=[2], logprobs=[-1.0],
                     reward=1.0, policy_version=0) for r in ("a", "b")]  # a group that agrees: no GRPO signal
    grpo, ppo = compute_advantages(ts, "grpo"), compute_advantages(ts, "ppo")
    assert [t.advantage for t in grpo] == [0.0, 0.0] and not any(has_signal(t, "grpo") for t in grpo)
    assert [(t.returns, t.advantage) for t in ppo] == [(1.0, 0.0)] * 2 and all(has_signal(t, "ppo") for t in ppo)


@pytest.fixture(scope="module")
def actor_critic():
    torch.manual_seed(0)
    model = WithValueHead(LlamaForCausalLM(LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, pad_token_id=0)).float())
    torch.nn.init.normal_(model.value_head.weight)  # zero at first in training: random here, to see it used
    return model


def samples() -> list[Transition]:
    return [Transition(rollout_id=f"r{i}", group_id="g", span_id=f"s{i}", prompt_ids=list(range(3, 3 + p)),
                       response_ids=list(range(40, 40 + r)), logprobs=[-1.0] * r, reward=g, returns=g,
                       policy_version=0) for i, (p, r, g) in enumerate([(4, 3, 1.0), (7, 5, 0.0), (2, 1, 1.0)])]


def test_the_value_head_reads_the_state_each_action_was_taken_in(actor_critic):
    t = samples()[0]
    values = score(actor_critic, collate([(t, 1.0)], pad_id=0)).values
    with torch.no_grad():
        ids = torch.tensor([[*t.prompt_ids, *t.response_ids]], dtype=torch.long)
        states = policy_of(actor_critic)(ids, output_hidden_states=True).hidden_states[-1][0]
        expected = actor_critic.value_head(states[len(t.prompt_ids) - 1 : -1]).squeeze(-1)  # predicts each action
    assert values.shape == (3,) and torch.allclose(values, expected, atol=1e-5)
    assert score(policy_of(actor_critic), collate([(t, 1.0)], pad_id=0)).values is None  # no critic, no values


def test_critic_advantages_are_whitened_gae_over_the_whole_batch_however_it_is_split(actor_critic):
    ts = samples()
    whole = [collate([(t, 1.0) for t in ts], pad_id=0)]
    split = [collate([(t, 1.0)], pad_id=0) for t in ts]
    critic_advantages(actor_critic, whole, PPO, None)
    critic_advantages(actor_critic, split, PPO, None)
    # λ = 1, no KL: each token's advantage is its sample's return minus the value there, then whitened
    values = [score(actor_critic, collate([(t, 1.0)], pad_id=0)).values.detach() for t in ts]
    raw = torch.cat([t.returns - v for t, v in zip(ts, values)])
    assert torch.allclose(whole[0]["advantages"], whiten(raw), atol=1e-5)
    assert torch.allclose(torch.cat([b["advantages"] for b in split]), whole[0]["advantages"], atol=1e-5)
    assert torch.allclose(whole[0]["returns"], torch.cat([torch.full_like(v, t.returns) for t, v in zip(ts, values)]))


def test_the_critics_pass_gives_every_batch_its_old_policy(actor_critic):
    """No weight has moved before it: its logprobs are the old policy's for every mini-batch, so PPO's later
    mini-batches need no forward of their own for it."""
    batches = [collate([(t, 1.0)], pad_id=0) for t in samples()]
    critic_advantages(actor_critic, batches, PPO, None)
    for batch in batches:
        assert torch.equal(batch["old_logprobs"], score(actor_critic, batch).logprobs.detach())
