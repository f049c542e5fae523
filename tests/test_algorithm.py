"""LightningRL's adapter and GRPO's math, on hand-built spans and transitions."""

from __future__ import annotations

import pytest
import torch

from lightning_ray.algorithm.grpo import group_advantages, policy_loss
from lightning_ray.algorithm.lightningrl import transitions_from_spans
from lightning_ray.tracing import semconv
from lightning_ray.types import Rollout, Span, Task, Transition


def llm_span(rollout, model, start, prompt, completion, attempt="at-1", version=0):
    return Span(rollout_id=rollout, attempt_id=attempt, name=semconv.LLM_CALL, start_time=start, attributes={
        semconv.MODEL: model, semconv.PROMPT_TOKEN_IDS: prompt, semconv.COMPLETION_TOKEN_IDS: completion,
        semconv.LOGPROBS: [-0.5] * len(completion), semconv.POLICY_VERSION: version})


def test_adapter_keeps_only_the_policys_calls_of_this_attempt_in_time_order():
    rollout = Rollout(rollout_id="ro-1", task=Task(task_id="t", input={}, group_id="g"), attempt_id="at-1")
    spans = [
        llm_span("ro-1", "policy", 2.0, [1, 2, 3], [7]),
        llm_span("ro-1", "gpt-judge", 1.5, [1], [9]),  # another model in the same agent: not ours to train
        llm_span("ro-1", "policy", 1.0, [1, 2], [5, 6]),
        llm_span("ro-1", "policy", 0.5, [1], [4], attempt="at-0"),  # an earlier, abandoned attempt
        Span(rollout_id="ro-1", attempt_id="at-1", name=semconv.REWARD, attributes={semconv.REWARD_VALUE: 0.75}),
    ]
    out = transitions_from_spans(rollout, spans, "policy")
    assert [t.response_ids for t in out] == [[5, 6], [7]]
    assert all(t.reward == 0.75 and t.group_id == "g" for t in out)


def transition(rollout, group, reward):
    return Transition(rollout_id=rollout, group_id=group, span_id=rollout, prompt_ids=[1], response_ids=[2],
                      logprobs=[-1.0], reward=reward, policy_version=0)


def test_group_advantages_are_relative_within_each_group():
    ts = [transition("a", "g1", 1.0), transition("a", "g1", 1.0), transition("b", "g1", 0.0),
          transition("c", "g2", 0.5), transition("d", "g2", 0.5)]
    adv = [t.advantage for t in group_advantages(ts)]
    # g1 holds rollouts a (1.0) and b (0.0): ±1 after std scaling; both transitions of a share its advantage
    assert adv[:3] == pytest.approx([1.0, 1.0, -1.0], abs=1e-4)
    assert adv[3:] == [0.0, 0.0]  # equal rewards: no signal
    assert [t.advantage for t in group_advantages(ts[:3], normalize_std=False)] == [0.5, 0.5, -0.5]


def test_policy_loss_pushes_up_positive_advantages_and_clips():
    logprobs = torch.zeros(1, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, stats = policy_loss(logprobs, torch.zeros(1, 3), torch.tensor([[2.0]]), mask, clip_eps=0.2)
    loss.backward()
    assert loss.item() == pytest.approx(-2.0)
    assert (logprobs.grad[0, :2] < 0).all() and logprobs.grad[0, 2] == 0  # masked token gets no gradient
    far = torch.full((1, 3), 1.0, requires_grad=True)  # ratio e ≈ 2.7: beyond the clip, gradient is cut
    loss, stats = policy_loss(far, torch.zeros(1, 3), torch.tensor([[1.0]]), mask, clip_eps=0.2)
    loss.backward()
    assert stats["clip_frac"] == 1.0 and far.grad.abs().sum() == 0
