"""Agent frameworks, unchanged, against our endpoint: LangChain's ChatOpenAI and a LangGraph ReAct agent.
The tiny model was warmed up on calculator function calls, so it really emits Hermes <tool_call> blocks."""

from __future__ import annotations

import json

import pytest
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from openai import OpenAI
from pydantic import BaseModel, Field

from lightning_ray.serving.tools import asking_span_id
from lightning_ray.tasks import calc

MODEL = "tiny-calc"
QUESTION = [{"role": "system", "content": calc.TOOL_SYSTEM_PROMPT}, {"role": "user", "content": "Calculate 3 + 20."}]


@pytest.fixture(scope="module")
def server(policy_app):
    with policy_app(rollout={"temperature": 0.0, "max_tokens": 48}) as app:
        yield app


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with + - * and parentheses."""
    return str(calc.calculate(expression))


def test_openai_client_gets_parsed_tool_calls_also_when_streaming(server):
    client = OpenAI(base_url=server["url"] + "/v1", api_key="EMPTY", max_retries=0)
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[calc.CALCULATOR_TOOL])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "calculator" and "expression" in json.loads(call.function.arguments)
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[calc.CALCULATOR_TOOL],
                                                 stream=True))
    streamed = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.function.name, tc.function.arguments) for tc in streamed] == [("calculator", call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    none = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[calc.CALCULATOR_TOOL], tool_choice="none")
    assert not none.choices[0].message.tool_calls  # tools withheld: nothing rendered, nothing parsed


def test_langchain_chat_model_plain_streaming_and_tools(server):
    llm = ChatOpenAI(model=MODEL, base_url=server["url"] + "/v1", api_key="EMPTY", max_retries=0, max_tokens=16)
    reply = llm.invoke([("system", calc.SYSTEM_PROMPT), ("user", "Calculate 3 + 20.")])
    assert reply.content and reply.response_metadata["model_name"] == MODEL
    assert "".join(c.content for c in llm.stream("What is 1 + 1?"))  # SSE through LangChain's stream parser
    # Tools given as the OpenAI dict the tiny model was warmed up on: its tool schema must match token for token.
    with_tools = ChatOpenAI(model=MODEL, base_url=server["url"] + "/v1", api_key="EMPTY", max_retries=0)
    call = with_tools.bind_tools([calc.CALCULATOR_TOOL]).invoke([("system", calc.TOOL_SYSTEM_PROMPT),
                                                                ("user", "Calculate 3 + 20.")])
    assert call.tool_calls and call.tool_calls[0]["name"] == "calculator"


class Sum(BaseModel):
    """The sum asked for."""
    value: int = Field(ge=-1000, le=1000)


def test_langchain_structured_output_by_a_forced_function_call(server):
    """LangChain's with_structured_output(method="function_calling") names the schema's function in tool_choice and
    parses the call's arguments: the endpoint guarantees that call (constrained decoding), where before a model that
    answered in prose (any small one) failed LangChain's parser."""
    llm = ChatOpenAI(model=MODEL, base_url=server["url"] + "/v1", api_key="EMPTY", max_retries=0, max_tokens=40)
    # under the plain-text system prompt the tiny model answers in prose (the test above) unless the call is forced
    out = llm.with_structured_output(Sum, method="function_calling").invoke([("system", calc.SYSTEM_PROMPT),
                                                                            ("user", "Calculate 3 + 20.")])
    assert isinstance(out, Sum)


def test_langgraph_react_agent_runs_tools_to_an_answer(server):
    from langgraph.prebuilt import create_react_agent

    rid = server["new_rollout"]()
    llm = ChatOpenAI(model=MODEL, base_url=server["url"] + f"/rollouts/{rid}/attempts/at-1/v1", api_key="EMPTY",
                     max_retries=0)
    # The model is bound to the dict schema it knows; LangGraph runs the real @tool when the model calls it.
    agent = create_react_agent(llm.bind_tools([calc.CALCULATOR_TOOL]), [calculator], prompt=calc.TOOL_SYSTEM_PROMPT)
    result = agent.invoke({"messages": [("user", "Calculate 3 + 20.")]}, {"recursion_limit": 6})
    kinds = [type(m).__name__ for m in result["messages"]]
    assert kinds[:3] == ["HumanMessage", "AIMessage", "ToolMessage"]  # the model called the tool, the tool ran
    assert result["messages"][2].content.lstrip("-").isdigit()
    # every model call the agent made was recorded under the rollout in its URL
    calls = server["store"].query_spans([rid])
    assert len(calls) == sum(k == "AIMessage" for k in kinds) >= 2
    # the tool call's id names the recorded answer that asked for it (what AIR credits a tool's reward by)
    first = min(calls, key=lambda s: s.start_time)
    assert asking_span_id(result["messages"][2].tool_call_id) == first.span_id
