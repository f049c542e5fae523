"""Automatic intermediate rewards: runtime signals → reward spans → step rewards, on hand-built traces and through
the real trace store (stored as the platform's, read back, credited to the calls they judge)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from lightning_ray.algorithm.air import RULE, air_spans
from lightning_ray.algorithm.lightningrl import recorded_calls, transitions_from_spans
from lightning_ray.config import AIRConfig
from lightning_ray.serving.tools import tool_call_id
from lightning_ray.tracing import semconv
from lightning_ray.tracing.spans import new_span_id
from lightning_ray.types import Rollout, Span, Task

RULES = AIRConfig(tool_ok=0.05, tool_error=-0.2, tool_timeout=-0.3, malformed_tool_call=-0.5,
                  format_pattern=r"ANSWER -?\d+", format_ok=0.1)


def call(start, response, rollout="ro-1"):
    return Span(span_id=new_span_id(), rollout_id=rollout, attempt_id="at-1", name=semconv.LLM_CALL, start_time=start,
                origin="server",
                attributes={semconv.MODEL: "policy", semconv.PROMPT_TOKEN_IDS: [1], semconv.COMPLETION_TOKEN_IDS: [2],
                            semconv.LOGPROBS: [-0.5], semconv.POLICY_VERSION: 0, "lightning_ray.response": response,
                            semconv.FINISH_REASONS: ["stop"]})


def tool(start, status="ok", error_type=None, message=None, call_id=None):
    attributes = {semconv.OPERATION: semconv.EXECUTE_TOOL, semconv.TOOL_NAME: "calculator"}
    if call_id:
        attributes[semconv.TOOL_CALL_ID] = call_id
    if error_type:
        attributes[semconv.ERROR_TYPE] = error_type
    return Span(rollout_id="ro-1", attempt_id="at-1", name="execute_tool calculator", start_time=start,
                status=status, status_message=message, attributes=attributes)


def episode() -> list[Span]:
    """Call 0 asks for a tool that fails; call 1 writes a broken tool call; a tool times out after it; call 2
    answers in the expected format."""
    return [call(1.0, '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>'),
            tool(1.5, "error", "ZeroDivisionError", "division by zero"),
            call(2.0, '<tool_call>{"name": calculator</tool_call>'),
            tool(2.5, "error", "TimeoutError", "tool timed out"),
            call(3.0, "ANSWER 42")]


def test_each_rule_gives_its_reward_to_the_signal_it_judges():
    spans = episode()
    rewards = air_spans(spans, RULES, recorded_calls)
    got = sorted((s.attributes[RULE], s.attributes[semconv.REWARD_VALUE], s.parent_id) for s in rewards)
    assert got == sorted([("tool_error", -0.2, spans[1].span_id), ("malformed_tool_call", -0.5, spans[2].span_id),
                          ("tool_timeout", -0.3, spans[3].span_id), ("format_ok", 0.1, spans[4].span_id)])
    assert all(s.name == semconv.REWARD and s.origin == "server" and s.rollout_id == "ro-1" for s in rewards)
    assert air_spans(spans, AIRConfig(), recorded_calls) == []  # every rule off: nothing


def test_air_rewards_become_step_rewards_of_the_calls_they_follow():
    spans = episode()
    rollout = Rollout(rollout_id="ro-1", task=Task(task_id="t", input={}), attempt_id="at-1", reward=1.0)
    out = transitions_from_spans(rollout, spans + air_spans(spans, RULES, recorded_calls), "policy")
    # call 0: its tool failed; call 1: malformed, then a tool timed out; call 2: well-formatted answer
    assert [t.step_reward for t in out] == pytest.approx([-0.2, -0.8, 0.1])
    assert [t.reward for t in out] == [1.0] * 3  # the final reward is the task's, untouched
    # an agent cannot pass its own reward spans off as AIR: client-origin rewards are not intermediate rewards
    forged = [s.model_copy(update={"origin": "client"}) for s in air_spans(spans, RULES, recorded_calls)]
    assert [t.step_reward for t in transitions_from_spans(rollout, spans + forged, "policy")] == [0.0] * 3


def test_a_tool_named_by_its_call_id_is_credited_to_the_call_that_asked_under_any_clock_skew():
    """The agent's machine runs 10 s behind the server's: by time alone both tools' rewards would go to the first
    call (the suspicion, confirmed). A tool span that reports its call's id (as the calc and rag agents do, with
    the ids the server gave) is credited to the call that asked for it; a tool another model's call asked for is
    no policy call's to reward."""
    calls = [call(100.0, "<tool_call>...</tool_call>"), call(101.0, "<tool_call>...</tool_call>"), call(102.0, "ANSWER 1")]
    other = call(101.5, "<tool_call>...</tool_call>")
    other.attributes[semconv.MODEL] = "helper"
    skewed = [tool(90.5, "error", "ValueError", call_id=tool_call_id(calls[0].span_id, 0)),
              tool(91.5, call_id=tool_call_id(calls[1].span_id, 0)),
              tool(91.6, "error", "ValueError", call_id=tool_call_id(other.span_id, 0))]
    rules = AIRConfig(tool_ok=0.05, tool_error=-0.2)
    policy = lambda spans: [c for c in recorded_calls(spans) if c.attributes[semconv.MODEL] == "policy"]
    spans = calls + [other] + skewed
    rollout = Rollout(rollout_id="ro-1", task=Task(task_id="t", input={}), attempt_id="at-1", reward=1.0)
    out = transitions_from_spans(rollout, spans + air_spans(spans, rules, policy), "policy")
    assert [t.step_reward for t in out] == pytest.approx([-0.2, 0.05, 0.0])
    by_time = [s.model_copy(update={"attributes": {k: v for k, v in s.attributes.items() if k != semconv.TOOL_CALL_ID}})
               for s in skewed[:2]]
    out = transitions_from_spans(rollout, calls + air_spans(calls + by_time, rules, policy), "policy")
    assert [t.step_reward for t in out] == pytest.approx([-0.15, 0.0, 0.0])  # what the clocks alone would do


def test_air_judges_only_answers_the_agent_got_and_its_rewards_must_be_finite():
    aborted = call(1.0, "ANSWER 4")  # cut off mid-answer: the agent never saw it, nor will the learner
    aborted.status, aborted.attributes[semconv.CALL_ERROR] = "error", "GeneratorExit: "
    assert air_spans([aborted], RULES, recorded_calls) == []
    with pytest.raises(ValidationError, match="finite"):
        AIRConfig(tool_error=float("-inf"))


def test_air_spans_are_stored_as_the_platforms_and_read_back(ray_cluster, tmp_path):
    from lightning_ray.store.client import StoreClient

    store = StoreClient.start(tmp_path)
    rollout_id = store.enqueue([Task(task_id="t", input={})])[0].rollout_id
    spans = [s.model_copy(update={"rollout_id": rollout_id}) for s in episode()]
    store.add_spans([s for s in spans if s.name == semconv.LLM_CALL], origin="server")
    store.add_spans([s for s in spans if s.name != semconv.LLM_CALL])  # the agent's tool spans
    stored = store.query_spans([rollout_id])
    store.add_spans(air_spans(stored, RULES, recorded_calls), origin="server")
    back = [s for s in store.query_spans([rollout_id]) if s.name == semconv.REWARD]
    assert len(back) == 4 and {s.origin for s in back} == {"server"}
    assert sorted(s.attributes[RULE] for s in back) == ["format_ok", "malformed_tool_call", "tool_error",
                                                         "tool_timeout"]
