"""The OpenAI Agents SDK, unchanged, against our /v1/responses (its default API): an Agent with a function tool,
run by the SDK's Runner. Tracing to OpenAI is off (no network here)."""

from __future__ import annotations

import asyncio

import pytest
import ray
from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

from lightning_ray.tasks import calc


@pytest.fixture(scope="module")
def server(policy_app):
    set_tracing_disabled(True)
    with policy_app(defaults={"temperature": 0.0, "max_tokens": 48}) as app:
        yield app


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with + - * and parentheses."""
    return str(calc.calculate(expression))


def test_agents_sdk_runner_completes_through_the_responses_api(server):
    rid = server["new_rollout"]()
    client = AsyncOpenAI(base_url=server["url"] + f"/rollouts/{rid}/attempts/at-1/v1", api_key="EMPTY", max_retries=0)
    agent = Agent(name="calc", instructions=calc.TOOL_SYSTEM_PROMPT, tools=[calculator],
                  model=OpenAIResponsesModel(model="tiny-calc", openai_client=client))
    result = asyncio.run(Runner.run(agent, "Calculate 3 + 20.", max_turns=4))
    calls = server["store"].query_spans([rid])
    assert calls and all(c.attributes["gen_ai.operation.name"] == "responses" for c in calls)
    assert calls[0].attributes["lightning_ray.request"]["tools"][0]["name"] == "calculator"  # the SDK's tool arrived
    # every model response the SDK received is one recorded policy call, and the run ends on the model's last text
    assert len(calls) == len(result.raw_responses)
    assert result.final_output == calls[-1].attributes["lightning_ray.response"]
