"""LightningRL's adapter and GRPO's math, on hand-built spans and transitions."""

from __future__ import annotations

import pickle
import time

import numpy as np
import pytest
import torch

from lightning_ray.algorithm.advantages import compute_advantages, step_returns
from lightning_ray.algorithm.loss import kl_to_reference, policy_loss, token_weights
from lightning_ray.algorithm.lightningrl import (adapt, merge_calls, scored_faithfully, spans_read,
                                                transitions_from_spans)
from lightning_ray.algorithm.select import Selection
from lightning_ray.config import AlgorithmConfig, SelectConfig
from lightning_ray.learner.driver import micro_batches
from lightning_ray.store.rows import span_row
from lightning_ray.store.sqlite import SQLiteBackend
from lightning_ray.tracing import semconv
from lightning_ray.types import Rollout, Span, Task, Transition


def llm_span(rollout, model, start, prompt, completion, attempt="at-1", version=0, origin="server"):
    return Span(rollout_id=rollout, attempt_id=attempt, name=semconv.LLM_CALL, start_time=start, origin=origin,
                attributes={semconv.MODEL: model, semconv.PROMPT_TOKEN_IDS: prompt,
                            semconv.COMPLETION_TOKEN_IDS: completion, semconv.LOGPROBS: [-0.5] * len(completion),
                            semconv.POLICY_VERSION: version, semconv.FINISH_REASONS: ["stop"]})


def reward_span(value, rollout="ro-1", attempt="at-1"):
    return Span(rollout_id=rollout, attempt_id=attempt, name=semconv.REWARD, attributes={semconv.REWARD_VALUE: value})


def test_adapter_keeps_only_the_policys_calls_of_this_attempt_in_time_order():
    rollout = Rollout(rollout_id="ro-1", task=Task(task_id="t", input={}, group_id="g"), attempt_id="at-1",
                      reward=0.75)
    spans = [
        llm_span("ro-1", "policy", 2.0, [1, 2, 3], [7]),
        llm_span("ro-1", "gpt-judge", 1.5, [1], [9]),  # another model in the same agent: not ours to train
        llm_span("ro-1", "policy", 1.0, [1, 2], [5, 6]),
        llm_span("ro-1", "policy", 0.5, [1], [4], attempt="at-0"),  # an earlier, abandoned attempt
        reward_span(0.75),
    ]
    out = transitions_from_spans(rollout, spans, "policy")
    assert [t.response_ids.tolist() for t in out] == [[5, 6], [7]]
    assert all(t.reward == 0.75 and t.group_id == "g" for t in out)


def test_training_data_comes_only_from_what_the_server_recorded():
    """Anyone holding the agent's key can post spans to the store's API: an LLM call with made-up tokens and a
    reward span. Neither becomes training data (the store marks them "client"), unless the task opts in to
    agent-emitted rewards; a malformed agent reward is passed over, not a crash."""
    rollout = Rollout(rollout_id="ro-1", task=Task(task_id="t", input={}), attempt_id="at-1", reward=0.0)
    real = llm_span("ro-1", "policy", 1.0, [1], [2])
    forged = llm_span("ro-1", "policy", 2.0, [1], [666], version=99, origin="client")
    spans = [real, forged, reward_span(1.0)]
    transitions = transitions_from_spans(rollout, spans, "policy")
    assert [(t.response_ids.tolist(), t.reward) for t in transitions] == [([2], 0.0)]
    opted_in = transitions_from_spans(rollout, spans + [reward_span("lots"), reward_span(float("nan"))], "policy",
                                      agent_rewards=True)
    assert [(t.response_ids.tolist(), t.reward) for t in opted_in] == [([2], 1.0)]  # the last well-formed one


def test_a_call_made_after_the_rollout_ended_is_not_trained():
    """A command agent's process that left its process group outlives its attempt, its key still valid: its calls
    after the rollout's end (recorded by the server, under the attempt) were trained with the attempt's reward."""
    rollout = Rollout(rollout_id="ro-1", task=Task(task_id="t", input={}), attempt_id="at-1", reward=1.0,
                      ended_at=10.0)
    spans = [llm_span("ro-1", "policy", 9.5, [1], [2]),
             llm_span("ro-1", "policy", 10.5, [1], [3]),  # within the clocks' slack: the agent's last, say
             llm_span("ro-1", "policy", 60.0, [1], [666])]
    assert [t.response_ids.tolist() for t in transitions_from_spans(rollout, spans, "policy")] == [[2], [3]]


def test_of_a_calls_n_choices_the_one_the_agent_went_on_from_is_trained():
    """n=3: a span per choice, all trained with the episode's reward, numbered as steps, though the agent went on from
    the first only (a wrong expression it never used was reinforced). The choice a later prompt extends is kept, its
    siblings left out; where none is gone on from (the last call), all stay."""
    rollout = Rollout(rollout_id="ro-1", task=Task(task_id="t", input={}), attempt_id="at-1", reward=1.0)
    first = [llm_span("ro-1", "policy", 1.0, [1, 2], completion) for completion in ([7], [8], [9])]
    later = llm_span("ro-1", "policy", 2.0, [1, 2, 7, 5], [3])  # goes on from choice [7]
    last = [llm_span("ro-1", "policy", 3.0, [1, 2, 7, 5, 3, 6], completion) for completion in ([4], [0])]
    out = transitions_from_spans(rollout, [*first, later, *last], "policy")
    assert [(t.response_ids.tolist(), t.step) for t in out] == [([7], 0), ([3], 1), ([4], 2), ([0], 3)]


def agent_span(span_id, parent, attributes, name="invoke_agent"):
    return Span(span_id=span_id, parent_id=parent, rollout_id="ro-1", attempt_id="at-1", name=name,
                attributes=attributes)


def under(parent, span):
    return span.model_copy(update={"parent_id": parent})


def two_agent_episode():
    """A workflow of a planner and a coder (GenAI's gen_ai.agent.name) and a reviewer (an OpenLLMetry CrewAI agent
    span), each LLM call nested under its agent's spans by the traceparent it sent, as the server records them."""
    return [
        agent_span("wf", None, {}, name="workflow"),
        agent_span("planner", "wf", {semconv.AGENT_NAME: "planner"}),
        agent_span("coder", "wf", {semconv.AGENT_NAME: "coder"}),
        agent_span("run-tests", "coder", {semconv.TOOL_NAME: "pytest"}, name="execute_tool pytest"),
        agent_span("reviewer", "wf", {"traceloop.span.kind": "agent"}, name="reviewer.agent"),
        under("planner", llm_span("ro-1", "policy", 1.0, [1], [10])),
        under("coder", llm_span("ro-1", "policy", 2.0, [1], [20])),
        under("coder", llm_span("ro-1", "gpt-judge", 2.5, [1], [25])),  # the coder's other model
        reward_span(0.5).model_copy(update={"start_time": 2.7}),  # the coder's tests passed
        under("run-tests", llm_span("ro-1", "policy", 3.0, [1], [30])),  # deeper: the nearest agent is the coder
        under("reviewer", llm_span("ro-1", "policy-v2", 4.0, [1], [40])),
        llm_span("ro-1", "policy", 5.0, [1], [50]),  # sent without a traceparent: no agent
        under("elsewhere", llm_span("ro-1", "policy", 6.0, [1], [60])),  # its parent is not in this rollout
        reward_span(1.0),
    ]


def selected(select=None, agent_rewards=True):
    rollout = Rollout(rollout_id="ro-1", task=Task(task_id="t", input={}), attempt_id="at-1", reward=0.0)
    return [(t.response_ids[0], t.step, t.step_reward)
            for t in transitions_from_spans(rollout, two_agent_episode(), "policy", agent_rewards, select)]


def test_calls_are_selected_by_model_regex():
    assert [c for c, _, _ in selected()] == [10, 20, 30, 50, 60]  # default: exactly the served model
    assert [c for c, _, _ in selected(Selection.of("policy", models=["policy(-v.*)?"]))] == [10, 20, 30, 40, 50, 60]
    assert [c for c, _, _ in selected(Selection.of("policy", models=["gpt-.*", "policy-v2"]))] == [25, 40]
    assert selected(Selection.of("policy", models=["polic"])) == []  # a regex matches the whole name


def test_calls_are_selected_by_the_agent_they_were_made_under():
    """Steps are numbered among the selected calls, and an agent reward goes to the last selected call before it."""
    coder = selected(Selection.of("policy", agents=["coder"]))
    assert coder == [(20, 0, 0.5), (30, 1, 0.0)]  # the tool's call belongs to the coder too; gpt-judge's does not
    assert selected(Selection.of("policy", agents=["planner"])) == [(10, 0, 0.5)]
    both = selected(Selection.of("policy", models=["policy.*"], agents=["plan.*", "reviewer"]))
    assert both == [(10, 0, 0.5), (40, 1, 0.0)]  # the reviewer named by OpenLLMetry's agent span
    assert selected(Selection.of("policy", agents=["wf|workflow"])) == []  # a span that names no agent


def test_the_trainers_lean_read_adapts_exactly_as_reading_every_span(tmp_path):
    """Without agent selection or AIR the trainer reads only the calls and rewards from the store: the transitions are
    the ones every span gives, for any model selection, reward source and level. Selecting by agent reads them all:
    a call's agent is among its ancestors, which the lean read would miss."""
    store = SQLiteBackend(tmp_path / "t.sqlite")
    store.enqueue([Rollout(rollout_id="ro-1", task=Task(task_id="t", input={}))])
    leased, attempt = store.dequeue("w0", time.time())
    rollout = leased.model_copy(update={"reward": 0.0})
    for origin in ("server", "client"):
        store.add_span_rows([span_row(s.model_copy(update={"attempt_id": attempt.attempt_id}))
                             for s in two_agent_episode() if (s.name == semconv.LLM_CALL) == (origin == "server")],
                            origin=origin)
    for models in (None, ["policy(-v.*)?"]):
        select = Selection.of("policy", models=models)
        lean = store.query_spans(["ro-1"], name=spans_read(select, air=False))
        assert {s.name for s in lean} == {semconv.LLM_CALL, semconv.REWARD} and len(lean) == 9
        for level in ("transition", "trajectory"):
            for agent_rewards in (False, True):
                full = adapt([rollout], store.query_spans(["ro-1"]), "policy", level, agent_rewards, select)
                assert adapt([rollout], lean, "policy", level, agent_rewards, select) == full and full[0]
        assert spans_read(select, air=True) is None  # AIR judges tool spans
    coder = Selection.of("policy", agents=["coder"])
    assert spans_read(coder, air=False) is None
    assert len(adapt([rollout], store.query_spans(["ro-1"]), "policy", select=coder)[0]) == 2
    assert adapt([rollout], store.query_spans(["ro-1"], name=[semconv.LLM_CALL, semconv.REWARD]), "policy",
                 select=coder)[0] == []


def test_an_agent_lookup_ends_on_a_cycle_of_parents():
    """Client spans are the agent's to send: parents that loop give no agent, not a hang."""
    spans = [agent_span("a", "b", {}), agent_span("b", "a", {}), under("a", llm_span("ro-1", "policy", 1.0, [1], [2]))]
    rollout = Rollout(rollout_id="ro-1", task=Task(task_id="t", input={}), attempt_id="at-1", reward=1.0)
    assert transitions_from_spans(rollout, spans, "policy", select=Selection.of("policy", agents=[".*"])) == []
    assert len(transitions_from_spans(rollout, spans, "policy")) == 1


def test_selection_config_rejects_what_would_select_nothing_by_mistake():
    assert SelectConfig().models is None and SelectConfig().agents is None
    for bad in ({"agents": ["coder("]}, {"models": []}, {"agents": []}):
        with pytest.raises(ValueError):
            SelectConfig(**bad)


def transition(rollout, group, reward, step=0, step_reward=0.0):
    return Transition(rollout_id=rollout, group_id=group, span_id=f"{rollout}{step}", prompt_ids=[1],
                      response_ids=[2], logprobs=[-1.0], reward=reward, step=step, step_reward=step_reward,
                      policy_version=0)


def advantages(ts, **options):
    return [t.advantage for t in compute_advantages(ts, **options)]


def test_group_advantages_are_relative_within_each_group():
    ts = [transition("a", "g1", 1.0), transition("a", "g1", 1.0, step=1), transition("b", "g1", 0.0),
          transition("c", "g2", 0.5), transition("d", "g2", 0.5)]
    adv = advantages(ts)
    # g1 holds rollouts a (1.0) and b (0.0): ±1 after std scaling; both transitions of a share its advantage
    assert adv[:3] == pytest.approx([1.0, 1.0, -1.0], abs=1e-4)
    assert adv[3:] == [0.0, 0.0]  # equal rewards: no signal
    assert advantages(ts[:3], estimator="dr_grpo") == [0.5, 0.5, -0.5]


def test_estimators_by_hand():
    """One group of three rollouts, final rewards 1, 0, 0.5: mean 0.5, population std sqrt(1/6) = 0.4082."""
    ts = [transition("a", "g", 1.0), transition("b", "g", 0.0), transition("c", "g", 0.5)]
    assert advantages(ts, estimator="grpo") == pytest.approx([0.5 / 0.408248, -0.5 / 0.408248, 0.0], abs=1e-4)
    assert advantages(ts, estimator="dr_grpo") == [0.5, -0.5, 0.0]
    # leave-one-out: a against mean(0, 0.5) = 0.25, b against 0.75, c against 0.5
    assert advantages(ts, estimator="rloo") == [0.75, -0.75, 0.0]
    # group-centred (0.5, -0.5, 0), then scaled by the batch's std of those: sqrt(1/6)
    assert advantages(ts, estimator="reinforce_pp") == pytest.approx([1.224745, -1.224745, 0.0], abs=1e-4)
    assert advantages(ts[:1], estimator="rloo") == [0.0]  # nobody to compare with: no signal


def test_step_returns_by_hand():
    """A three-step episode: intermediate rewards 0.1, 0, -0.2 after its calls, final reward 1."""
    steps = [transition("a", "g", 1.0, step=i, step_reward=r) for i, r in enumerate([0.1, 0.0, -0.2])]
    assert step_returns(steps, "terminal") == [1.0, 1.0, 1.0]
    assert step_returns(steps, "per_step") == pytest.approx([0.1, 0.0, 0.8])
    # G2 = 0.8; G1 = 0 + 0.5 * 0.8 = 0.4; G0 = 0.1 + 0.5 * 0.4 = 0.3
    assert step_returns(steps, "discounted", gamma=0.5) == pytest.approx([0.3, 0.4, 0.8])
    assert step_returns(steps, "discounted", gamma=1.0) == pytest.approx([0.9, 0.8, 0.8])


def test_turn_level_baseline_compares_each_step_with_the_same_step_of_the_others():
    """Rollout a: steps earn 1 then 0; rollout b: 0 then 0, plus a third step nobody else reached (reward 1).
    Per-step credit, Dr. GRPO (no std) so the numbers stay readable."""
    a = [transition("a", "g", 0.0, step=0, step_reward=1.0), transition("a", "g", 0.0, step=1)]
    b = [transition("b", "g", 1.0, step=0), transition("b", "g", 1.0, step=1),
         transition("b", "g", 1.0, step=2)]  # final reward 1 lands on b's last step
    turn = advantages(a + b, estimator="dr_grpo", credit="per_step", baseline="turn")
    # step 0: a 1 vs b 0 (mean 0.5); step 1: a 0 vs b 0; b's step 2 (return 1) falls back to the group baseline:
    # the rollouts' average returns, a (1 + 0) / 2 = 0.5 and b (0 + 0 + 1) / 3 = 1/3, mean 5/12
    assert turn == pytest.approx([0.5, 0.0, -0.5, 0.0, 1 - 5 / 12])
    group = advantages(a + b, estimator="dr_grpo", credit="per_step", baseline="group")
    assert group == pytest.approx([1 - 5 / 12, -5 / 12, -5 / 12, -5 / 12, 1 - 5 / 12])


@pytest.mark.parametrize("credit", ["per_step", "discounted"])
def test_grpo_scales_by_the_spread_of_the_returns_it_compares_not_of_the_rollouts_averages(credit):
    """Four rollouts each solved in two calls, the final reward on the second: per-step returns 0 then 1 (discounted
    0.9, 1), the rollouts' averages all alike. Scaled by the averages' std (0) the steps' advantages were ±5e5."""
    ts = [transition(r, "g", 1.0, step=s) for r in "abcd" for s in (0, 1)]
    out = advantages(ts, estimator="grpo", credit=credit, gamma=0.9)
    assert out == pytest.approx([-1.0, 1.0] * 4, abs=1e-4)
    # terminal credit: the std of the final rewards, as before (one rollout of two steps weighs as one of one)
    mixed = [transition("a", "g", 1.0), transition("a", "g", 1.0, step=1), transition("b", "g", 0.0)]
    assert advantages(mixed, estimator="grpo") == pytest.approx([1.0, 1.0, -1.0], abs=1e-4)


def test_agent_rewards_before_the_last_become_the_step_rewards_of_the_calls_they_follow():
    rollout = Rollout(rollout_id="ro-1", task=Task(task_id="t", input={}), attempt_id="at-1", reward=0.0)
    spans = [llm_span("ro-1", "policy", 1.0, [1], [2]), llm_span("ro-1", "policy", 3.0, [1], [3])]
    rewards = [(0.5, 0.2), (2.0, 0.3), (2.5, -0.1), (4.0, 1.0)]  # (time, value): the last is the final reward
    spans += [reward_span(v).model_copy(update={"start_time": when}) for when, v in rewards]
    # and last, the runner's record of the task's own reward (rollout/runner.py): not the agent's
    spans.append(reward_span(0.0).model_copy(update={"start_time": 5.0, "attributes": {
        semconv.REWARD_VALUE: 0.0, semconv.REWARD_TASK: True}}))
    out = transitions_from_spans(rollout, spans, "policy", agent_rewards=True)
    assert [(t.step, t.step_reward, t.reward) for t in out] == [(0, pytest.approx(0.4), 1.0), (1, 0.0, 1.0)]
    # not opted in: the task's own reward, and nothing intermediate (an agent's rewards are not trusted)
    assert [(t.step_reward, t.reward) for t in transitions_from_spans(rollout, spans, "policy")] == [(0.0, 0.0)] * 2


def test_policy_loss_pushes_up_positive_advantages_and_clips():
    logprobs = torch.zeros(2, requires_grad=True)
    weights = torch.tensor([0.5, 0.5])
    loss, stats = policy_loss(logprobs, torch.zeros(2), torch.tensor([2.0, 2.0]), weights, clip_eps=0.2)
    loss.backward()
    assert loss.item() == pytest.approx(-2.0)
    assert (logprobs.grad < 0).all()
    far = torch.full((2,), 1.0, requires_grad=True)  # ratio e ≈ 2.7: beyond the clip, gradient is cut
    loss, stats = policy_loss(far, torch.zeros(2), torch.tensor([1.0, 1.0]), weights, clip_eps=0.2)
    loss.backward()
    assert stats["clip_frac"] == 1.0 and far.grad.abs().sum() == 0


def test_clip_higher_leaves_more_room_above_than_below():
    weights = torch.tensor([0.5, 0.5])
    ratios = torch.log(torch.tensor([1.25, 0.75])).requires_grad_()  # one above 1 + 0.2, one below 1 - 0.2
    loss, stats = policy_loss(ratios, torch.zeros(2), torch.tensor([1.0, -1.0]), weights, clip_eps=0.2,
                              clip_eps_high=0.28)
    loss.backward()
    assert stats["clip_frac"] == 0.5  # 1.25 is inside [0.8, 1.28]; 0.75 is below 0.8
    assert ratios.grad[0] != 0 and ratios.grad[1] == 0
    symmetric = torch.log(torch.tensor([1.25, 0.75])).requires_grad_()
    policy_loss(symmetric, torch.zeros(2), torch.tensor([1.0, -1.0]), weights, clip_eps=0.2)[0].backward()
    assert symmetric.grad.abs().sum() == 0  # both outside [0.8, 1.2]: no gradient


def test_response_diversity_counts_distinct_episodes_per_group():
    from lightning_ray.trainer.record import response_diversity

    def call(rollout, group, step, ids):
        return transition(rollout, group, 1.0, step=step).model_copy(update={"response_ids": np.array(ids, np.int32)})

    # g1: a and b answer alike call for call, c differs in its second call -> 2 distinct of 3; g2: 2 of 2
    ts = [call("a", "g1", 0, [1]), call("a", "g1", 1, [2]), call("b", "g1", 0, [1]), call("b", "g1", 1, [2]),
          call("c", "g1", 0, [1]), call("c", "g1", 1, [3]), call("d", "g2", 0, [1]), call("e", "g2", 0, [4])]
    assert response_diversity(ts) == pytest.approx((2 / 3 + 1) / 2)


def test_kl_estimators_by_hand():
    logprobs, ref = torch.log(torch.tensor([0.5, 0.2])), torch.log(torch.tensor([0.25, 0.4]))
    # k1 = log(p / p_ref): log 2, log 0.5; k3 = r - log r - 1 with r = p_ref / p: 0.5 + log 2 - 1, 2 - log 2 - 1
    assert kl_to_reference(logprobs, ref, "k1").tolist() == pytest.approx([0.693147, -0.693147], abs=1e-5)
    assert kl_to_reference(logprobs, ref, "k3").tolist() == pytest.approx([0.193147, 0.306853], abs=1e-5)
    assert kl_to_reference(logprobs, logprobs, "k3").tolist() == [0.0, 0.0]


def test_k1_is_refused_as_a_loss_term():
    """As a loss, k1 = log π − log π_ref on tokens π sampled has the gradient ∇log π, whose expectation is 0: it would
    not pull towards the reference. As a reward penalty (PPO's) it is fine."""
    with pytest.raises(ValueError, match="algorithm.kl_estimator=k1"):
        AlgorithmConfig(kl_coef=0.1, kl_estimator="k1")
    AlgorithmConfig(kl_coef=0.1, kl_estimator="k1", kl_penalty="reward", estimator="ppo")
    AlgorithmConfig(kl_coef=0.1, kl_estimator="k3")


def test_calls_cut_off_at_max_tokens_are_counted():
    rollout = Rollout(rollout_id="ro-1", task=Task(task_id="t", input={}), attempt_id="at-1", reward=1.0)
    spans = [llm_span("ro-1", "policy", float(i), [1], [2]) for i in range(4)]
    for s, reason in zip(spans, ["stop", "length", "stop", "length"]):
        s.attributes["gen_ai.response.finish_reasons"] = [reason]
    out, stats = adapt([rollout], spans, "policy")
    assert [t.finish_reason for t in out] == ["stop", "length", "stop", "length"]
    assert stats["truncated_calls"] == 2 and stats["policy_calls"] == 4


def sized(response_len, advantage=1.0, prompt_len=4):
    return Transition(rollout_id="r", group_id="g", span_id="s", prompt_ids=[1] * prompt_len,
                      response_ids=[2] * response_len, logprobs=[-1.0] * response_len, reward=1.0,
                      advantage=advantage, policy_version=0)


@pytest.mark.parametrize("aggregation, expected", [
    ("token_mean", [1 / 4, 1 / 4]),            # 4 tokens in all, each counts the same
    ("sequence_mean", [1 / 2, 1 / 6]),          # each transition's mean, then the mean over the 2
    ("token_sum", [1 / 20, 1 / 20]),            # over 2 transitions × max_tokens 10
])
def test_token_weights_sum_the_loss_over_the_whole_batch(aggregation, expected):
    batch = [sized(1), sized(3)]
    weights = token_weights(batch, aggregation, max_tokens=10)
    assert [w.tolist() for w in weights] == [pytest.approx([expected[0]]), pytest.approx([expected[1]] * 3)]
    if aggregation != "token_sum":  # a mean: the weights of all tokens add up to 1
        assert sum(w.sum() for w in weights) == pytest.approx(1.0)
    # the two calls merged into one sequence (trajectory level): each call weighs what it did alone
    merged = sized(4).model_copy(update={"call_tokens": [1, 3]})
    assert token_weights([merged], aggregation, max_tokens=10)[0].tolist() == pytest.approx(np.concatenate(weights))


def test_micro_batches_stay_within_the_token_budget_and_keep_every_transition():
    batch = [(sized(r, prompt_len=p), 0.1) for r, p in [(5, 20), (40, 60), (3, 10), (30, 90), (200, 300), (8, 8)]]
    packed = micro_batches(batch, token_budget=256)
    assert sorted(id(t) for mb in packed for t, _ in mb) == sorted(id(t) for t, _ in batch)
    for mb in packed:
        width = max(len(t.prompt_ids) + len(t.response_ids) for t, _ in mb)
        assert len(mb) * width <= 256 or len(mb) == 1  # a row over the budget goes alone
    assert len(packed) < len(batch)  # short rows share a micro-batch


def test_rollouts_the_platform_failed_give_no_transitions():
    rollout = Rollout(rollout_id="ro-1", task=Task(task_id="t", input={}), attempt_id="at-1", status="failed",
                      reward=None, error="APIConnectionError: Connection error.")
    assert transitions_from_spans(rollout, [llm_span("ro-1", "policy", 1.0, [1], [2])], "policy") == []
    scored_zero = rollout.model_copy(update={"reward": 0.0})  # the agent's own failure: the policy scored 0
    assert [t.reward for t in transitions_from_spans(scored_zero, [llm_span("ro-1", "policy", 1.0, [1], [2])],
                                                     "policy")] == [0.0]


def test_rollouts_whose_reward_is_not_finite_are_left_out_as_the_platforms_failures():
    """A NaN or infinite final reward, or AIR reward (the platform's own; one stored as JSON null was infinite),
    excludes the rollout and is counted with the rollouts the platform failed; the others are adapted as usual."""
    def rollout(rid, reward):
        return Rollout(rollout_id=rid, task=Task(task_id="t", input={}, group_id="g"), attempt_id="at-1", reward=reward)

    def air(rid, value):
        return reward_span(value, rid).model_copy(update={"origin": "server"})

    rollouts = [rollout("ok", 1.0), rollout("inf", float("inf")), rollout("nan", float("nan")), rollout("none", None),
                rollout("air-inf", 0.0), rollout("air-null", 0.0)]
    spans = [llm_span(r.rollout_id, "policy", 1.0, [1], [2]) for r in rollouts]
    spans += [air("ok", 0.1), air("air-inf", float("-inf")), air("air-null", None)]
    transitions, counts = adapt(rollouts, spans, "policy")
    assert [(t.rollout_id, t.step_reward) for t in transitions] == [("ok", 0.1)]
    assert counts["infra_failed_rollouts"] == 5 and counts["policy_calls"] == 1
    assert all(transitions_from_spans(r, spans, "policy") == [] for r in rollouts[1:])


def test_calls_the_agent_never_got_an_answer_to_make_no_transitions():
    """An errored or aborted call (its partial sample), or one without a finish reason, stays in the trace but is
    not trained; its siblings are, numbered among themselves, and AIR's rewards go to the calls the agent saw."""
    rollout = Rollout(rollout_id="ro-1", task=Task(task_id="t", input={}), attempt_id="at-1", reward=1.0)
    first, aborted, unfinished, retry = (llm_span("ro-1", "policy", float(i), [1], [2 + i]) for i in range(4))
    aborted.status, aborted.status_message = "error", "CancelledError: "
    aborted.attributes.update({semconv.CALL_ERROR: "CancelledError: ", semconv.FINISH_REASONS: [None]})
    del unfinished.attributes[semconv.FINISH_REASONS]
    late = reward_span(-0.5).model_copy(update={"origin": "server", "start_time": 3.5})  # after the retry
    transitions, counts = adapt([rollout], [first, aborted, unfinished, retry, late], "policy")
    assert [(t.span_id, t.step, t.step_reward) for t in transitions] == [(first.span_id, 0, 0.0),
                                                                          (retry.span_id, 1, -0.5)]
    assert counts["policy_calls"] == 2 and counts["unanswered_calls"] == 2
    errored = first.model_copy(update={"status": "error"})  # the status alone is enough (any OTel-style recorder)
    assert transitions_from_spans(rollout, [errored], "policy") == []


def test_estimators_leave_out_a_rollout_whose_return_is_not_finite():
    """Rewards 1, 0, inf, 0 in one group: grpo and reinforce_pp used to raise, rloo and dr_grpo to give ±inf / NaN
    advantages that counted as signal. The rollout is left out, and the group is judged as if it had not run."""
    ts = [transition("a", "g", 1.0), transition("b", "g", 0.0), transition("d", "g", 0.0)]
    for bad in (float("inf"), float("-inf"), float("nan")):
        poisoned = ts[:2] + [transition("c", "g", bad)] + ts[2:]
        for estimator in ("grpo", "dr_grpo", "rloo", "reinforce_pp", "ppo"):
            out = compute_advantages(poisoned, estimator)
            assert [t.rollout_id for t in out] == ["a", "b", "d"], (estimator, bad)
            assert out == compute_advantages(ts, estimator), (estimator, bad)
        stepped = ts + [transition("c", "g", 0.0, step=1, step_reward=bad)]  # an intermediate reward, per_step
        assert [t.rollout_id for t in compute_advantages(stepped, credit="per_step")] == ["a", "b", "d"]
    assert advantages(ts, estimator="dr_grpo") == pytest.approx([2 / 3, -1 / 3, -1 / 3])


def test_transitions_carry_the_temperature_their_call_was_sampled_at():
    rollout = Rollout(rollout_id="ro-1", task=Task(task_id="t", input={}), attempt_id="at-1", reward=1.0)
    span = llm_span("ro-1", "policy", 1.0, [1], [2])
    span.attributes[semconv.SAMPLING] = {"temperature": 0.7, "top_p": 1.0, "seed": None, "constrained": False}
    assert transitions_from_spans(rollout, [span], "policy")[0].temperature == 0.7
    assert scored_faithfully(span)
    span.attributes[semconv.SAMPLING]["top_p"] = 0.9
    assert not scored_faithfully(span)


def call(rollout, prompt, response, temperature=1.0):
    return Transition(rollout_id=rollout, group_id="g", span_id=f"{rollout}-{len(prompt)}", prompt_ids=prompt,
                      response_ids=response, logprobs=[-0.1 * (i + 1) for i in range(len(response))], reward=1.0,
                      policy_version=0, temperature=temperature)


def test_calls_whose_prompts_extend_the_context_merge_into_one_masked_sequence():
    first = call("a", [1, 2, 3], [4, 5])
    second = call("a", [1, 2, 3, 4, 5, 9, 9], [6])  # the tool result (9, 9) between the two answers
    third = call("a", [1, 2, 3, 4, 5, 9, 9, 6, 8], [7])
    other = call("b", [1, 2], [3])
    merged, breaks = merge_calls([first, second, third, other])
    assert breaks == 0 and len(merged) == 2
    m = merged[0]
    assert m.prompt_ids.tolist() == [1, 2, 3] and m.response_ids.tolist() == [4, 5, 9, 9, 6, 8, 7]
    assert m.loss_mask.tolist() == [1, 1, 0, 0, 1, 0, 1] and m.action_tokens == 4 and m.call_tokens == [2, 1, 1]
    assert m.logprobs[m.loss_mask == 1].tolist() == [*first.logprobs, *second.logprobs, *third.logprobs]
    assert not m.logprobs[m.loss_mask == 0].any()  # the tool result's tokens were not sampled
    assert merged[1] == other


def test_a_grammar_constrained_call_merges_only_with_constrained_ones_and_a_wholly_forced_one_weighs_nothing():
    """(Its tokens are not compared with the learner's or importance-weighted: a sequence is one or the other.)"""
    first = call("a", [1, 2, 3], [4, 5])
    forced = call("a", [1, 2, 3, 4, 5, 9], [6]).model_copy(update={"constrained": True,
                                                                   "loss_mask": np.zeros(1, np.int8)})
    merged, breaks = merge_calls([first, forced])
    assert breaks == 0 and [m.constrained for m in merged] == [False, True]
    weights = token_weights(merged, "sequence_mean", max_tokens=4)
    assert [w.tolist() for w in weights] == [[0.5, 0.5], []]  # one call with actions: its tokens share 1


def test_a_re_rendered_prompt_breaks_the_sequence_and_is_counted():
    first = call("a", [1, 2, 3], [4, 5])
    drifted = call("a", [1, 2, 3, 45, 9], [6])  # the answer re-tokenized as one token: not the sampled ids
    merged, breaks = merge_calls([first, drifted])
    assert breaks == 1 and merged == [first, drifted]
    cooler = call("a", [1, 2, 3, 4, 5, 9], [6], temperature=0.5)  # scored at another temperature: kept apart
    assert len(merge_calls([first, cooler])[0]) == 2


def test_a_call_cut_off_at_max_tokens_stays_apart_so_the_overlong_filter_drops_it_alone():
    """algorithm.overlong_filter leaves out a cut-off call; merged into its episode's sequence it took the whole
    episode with it (its complete calls too), where the transition level drops that call only."""
    first = call("a", [1, 2, 3], [4, 5])
    cut = call("a", [1, 2, 3, 4, 5, 9], [6, 6]).model_copy(update={"finish_reason": "length"})
    last = call("a", [1, 2, 3, 4, 5, 9, 6, 6, 8], [7])
    merged, breaks = merge_calls([first, cut, last])
    assert breaks == 0 and [m.finish_reason for m in merged] == [None, "length", None]
    kept = [m for m in merged if m.finish_reason != "length"]  # the filter (trainer/collect.py)
    assert sum(m.action_tokens for m in kept) == 3 == first.action_tokens + last.action_tokens


def test_adapt_reports_calls_and_drift():
    rollout = Rollout(rollout_id="ro-1", task=Task(task_id="t", input={}), attempt_id="at-1", reward=1.0)
    spans = [llm_span("ro-1", "policy", 1.0, [1, 2], [3]), llm_span("ro-1", "policy", 2.0, [1, 2, 3, 7], [4])]
    transitions, stats = adapt([rollout], spans, "policy", "trajectory")
    assert len(transitions) == 1 and transitions[0].response_ids.tolist() == [3, 7, 4]
    assert stats == {"policy_calls": 2, "action_tokens": 2, "truncated_calls": 0, "unanswered_calls": 0,
                     "call_joins": 1, "prefix_breaks": 0, "infra_failed_rollouts": 0, "calls_across_updates": 0}
    transitions, stats = adapt([rollout], spans, "policy", "transition")
    assert len(transitions) == 2


def test_token_arrays_reach_the_transition_from_the_store_exactly(tmp_path):
    """Token ids (int32), logprobs (float64, bit for bit) and, merged, the loss mask (int8) go from the SQLite store
    to the Transition as numpy arrays, the stored bytes themselves (no list, no copy); a Transition built from the
    same numbers as lists is equal to it, one with other numbers is not."""
    store = SQLiteBackend(tmp_path / "t.sqlite")
    store.enqueue([Rollout(rollout_id="ro-1", task=Task(task_id="t", input={}, group_id="g"))])
    leased, attempt = store.dequeue("w0", time.time())
    rollout = leased.model_copy(update={"reward": 1.0})
    calls = [([151_643, 0, 2**31 - 1], [5, 6], [-0.1, -1234.56789012345678]),
             ([151_643, 0, 2**31 - 1, 5, 6, 9], [7], [5e-324])]  # the second call's prompt extends the first's
    spans = [llm_span("ro-1", "policy", float(i), prompt, completion, attempt=attempt.attempt_id)
             for i, (prompt, completion, _) in enumerate(calls)]
    for span, (_, _, logprobs) in zip(spans, calls):
        span.attributes[semconv.LOGPROBS] = logprobs
    store.add_span_rows([span_row(s) for s in spans], origin="server")
    read = store.query_spans(["ro-1"])

    transitions, _ = adapt([rollout], read, "policy")
    for t, span, (prompt, completion, logprobs) in zip(transitions, read, calls, strict=True):
        assert [a.dtype for a in (t.prompt_ids, t.response_ids, t.logprobs)] == [np.int32, np.int32, np.float64]
        assert t.prompt_ids is span.attributes[semconv.PROMPT_TOKEN_IDS]
        assert t.prompt_ids.tolist() == prompt and t.response_ids.tolist() == completion
        assert t.logprobs.tobytes() == np.array(logprobs).tobytes()
        from_lists = Transition(**{**t.model_dump(), "prompt_ids": prompt, "response_ids": completion,
                                   "logprobs": logprobs})
        assert from_lists == t and pickle.loads(pickle.dumps(t)) == t
        assert Transition(**{**t.model_dump(), "logprobs": [lp - 1 for lp in logprobs]}) != t

    [merged], _ = adapt([rollout], read, "policy", "trajectory")
    dtypes = [a.dtype for a in (merged.response_ids, merged.logprobs, merged.loss_mask)]
    assert dtypes == [np.int32, np.float64, np.int8]
    assert merged.response_ids.tolist() == [5, 6, 9, 7] and merged.loss_mask.tolist() == [1, 1, 0, 1]
    assert merged.logprobs.tobytes() == np.array([-0.1, -1234.56789012345678, 0.0, 5e-324]).tobytes()
    assert Transition(**{**merged.model_dump(mode="json")}) == merged  # JSON lists back to the same arrays
