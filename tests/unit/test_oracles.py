"""Imitation's parts that start nothing: the tasks' oracles, a teacher's answer as the policy's tokens, the adapter's
rule that a teacher's calls are never RL data, and the config's checks."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from lightning_ray.algorithm.lightningrl import adapt
from lightning_ray.config import TrainConfig
from lightning_ray.serving.chat import template_messages
from lightning_ray.serving.teacher import answer_tokens
from lightning_ray.serving.tools import parse_tool_calls
from lightning_ray.tasks import calc, rag, sql
from lightning_ray.tasks.sql.workflow import CHECKER_PROMPT, WRITER_PROMPT, extract_sql
from lightning_ray.tracing import semconv
from lightning_ray.types import Rollout, Span, Task


def said(tokenizer, messages, tools, answer) -> str:
    """The teacher's answer as the policy would have written it: its tokens, decoded as the server does."""
    ids = answer_tokens(tokenizer, template_messages(messages), tools, answer)
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>") or tokenizer.decode(ids).endswith("\n")
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_the_calc_oracle_calls_the_calculator_then_answers(tokenizer):
    task = calc.make_tasks(1, seed=0, protocol="tools")[0]
    messages = [*calc.opening(task.input), {"role": "user", "content": task.input["question"]}]
    tools = [calc.CALCULATOR_TOOL]
    _, [call] = parse_tool_calls(said(tokenizer, messages, tools, calc.oracle(task.reward_input, messages, tools)))
    expression = json.loads(call["function"]["arguments"])["expression"]
    assert call["function"]["name"] == "calculator" and str(calc.calculate(expression)) == task.reference["answer"]
    messages += [{"role": "assistant", "content": None, "tool_calls": [{**call, "id": "c"}]},
                 {"role": "tool", "tool_call_id": "c", "content": task.reference["answer"]}]
    answer = said(tokenizer, messages, tools, calc.oracle(task.reward_input, messages, tools))
    assert calc.reward(task.reward_input, answer.removeprefix("ANSWER ").strip()) == 1.0


def test_the_sql_oracle_writes_the_gold_query_and_approves_it(tokenizer):
    task = sql.make_tasks(1, seed=0)[0]
    writer = [{"role": "system", "content": WRITER_PROMPT}, {"role": "user", "content": task.input["question"]}]
    query = extract_sql(said(tokenizer, writer, None, sql.oracle(task.reward_input, writer, None)))
    assert sql.reward(task.reward_input, query) == 1.0
    checker = [{"role": "system", "content": CHECKER_PROMPT}, {"role": "user", "content": query}]
    assert sql.oracle(task.reward_input, checker, None)["content"] == "CORRECT"


def test_the_rag_oracle_searches_each_hop_then_answers():
    task = rag.make_tasks(1, seed=0, options={"people": 20})[0]
    messages = [{"role": "user", "content": "an earlier question"}, {"role": "tool", "content": "..."},
                {"role": "user", "content": task.input["question"]}]
    queries = []
    for _ in task.reference["decomposition"]:
        [call] = rag.oracle(task.reward_input, messages, [{}])["tool_calls"]
        queries.append(json.loads(call["function"]["arguments"])["query"])
        messages += [{"role": "assistant", "tool_calls": [call]}, {"role": "tool", "content": "passages"}]
    assert queries == task.reference["decomposition"]  # the earlier question's search is not counted
    final = rag.oracle(task.reward_input, messages, [{}])["content"]
    assert rag.reward(task.reward_input, final) == 1.0


def test_a_teachers_calls_are_imitation_data_never_rl_data():
    rollout = Rollout(rollout_id="ro", task=Task(task_id="t", input={}), attempt_id="at", reward=1.0)
    call = {semconv.MODEL: "policy", semconv.PROMPT_TOKEN_IDS: [1], semconv.COMPLETION_TOKEN_IDS: [2],
            semconv.LOGPROBS: [-0.1], semconv.POLICY_VERSION: 0, semconv.FINISH_REASONS: ["stop"]}
    spans = [Span(rollout_id="ro", attempt_id="at", name=semconv.LLM_CALL, origin="server", start_time=t,
                  attributes={**call, **({semconv.TEACHER: "oracle:calc"} if taught else {})})
             for t, taught in ((1.0, True), (2.0, False))]
    rl, _ = adapt([rollout], spans, "policy")
    imitation, _ = adapt([rollout], spans, "policy", imitation=True)
    assert [t.span_id for t in rl] == [spans[1].span_id]
    assert [t.span_id for t in imitation] == [s.span_id for s in spans]


@pytest.mark.parametrize("raw, named", [
    ({"teacher": {"kind": "oracle"}}, "algorithm.objective=sft"),
    ({"teacher": {"kind": "model"}, "algorithm": {"objective": "sft"}}, "teacher.path"),
    ({"teacher": {"kind": "endpoint", "base_url": "http://x/v1"}, "algorithm": {"objective": "sft"}}, "teacher.model"),
])
def test_a_teacher_config_that_cannot_work_is_refused_by_key(raw, named):
    with pytest.raises(ValidationError, match=named):
        TrainConfig.model_validate({"run_dir": "r", **raw})
