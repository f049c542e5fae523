"""The OpenAI Agents SDK, unchanged, against our /v1/responses (its default API): an Agent with a function tool,
run by the SDK's Runner. Tracing to OpenAI is off (no network here)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

from lightning_ray.algorithm.lightningrl import transitions_from_spans
from lightning_ray.algorithm.select import Selection
from lightning_ray.tasks import calc
from lightning_ray.tracing import trace_attempt
from lightning_ray.tracing.otel import setup_otel
from lightning_ray.types import Rollout, Task


@pytest.fixture(scope="module")
def server(policy_app):
    set_tracing_disabled(True)
    with policy_app(rollout={"temperature": 0.0, "max_tokens": 48}) as app:
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


def test_a_two_agent_workflow_trains_the_agent_selected_by_name(server):
    """Two SDK agents in one rollout. OpenInference's instrumentation turns the SDK's agent spans into OpenTelemetry
    spans named by agent, OpenTelemetry's httpx instrumentation sends each call's traceparent, so the server's LLM
    spans nest under them in the store and selection by agent name picks each agent's own calls."""
    from openinference.instrumentation.openai_agents import OpenAIAgentsInstrumentor
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor

    rid = server["new_rollout"]()
    http_client = httpx.AsyncClient(timeout=120)
    HTTPXClientInstrumentor.instrument_client(http_client)  # this client only: other tests' requests stay as they are
    client = AsyncOpenAI(base_url=server["url"] + f"/rollouts/{rid}/attempts/at-1/v1", api_key="EMPTY",
                         max_retries=0, http_client=http_client)
    model = OpenAIResponsesModel(model="tiny-calc", openai_client=client)
    planner = Agent(name="planner", instructions="Restate the problem in one line.", model=model)
    solver = Agent(name="solver", instructions=calc.TOOL_SYSTEM_PROMPT, tools=[calculator], model=model)

    async def workflow():  # orchestration is plain code: it names no agent to the platform
        plan = await Runner.run(planner, "Calculate 3 + 20.", max_turns=1)
        return plan, await Runner.run(solver, "Calculate 3 + 20.", max_turns=4)

    instrumentor = OpenAIAgentsInstrumentor()
    instrumentor.instrument(tracer_provider=setup_otel())  # in place of the SDK's exporter to OpenAI
    set_tracing_disabled(False)
    try:
        with trace_attempt(rid, "at-1", server["store"].add_spans, backend="otel"):
            plan, solved = asyncio.run(workflow())
    finally:
        set_tracing_disabled(True)
        instrumentor.uninstrument()
    spans = server["store"].query_spans([rid])
    rollout = Rollout(rollout_id=rid, task=Task(task_id="t", input={}), attempt_id="at-1", reward=1.0)

    def calls_of(agents):
        return transitions_from_spans(rollout, spans, "tiny-calc", select=Selection.of("tiny-calc", agents=agents))

    text = {s.span_id: s.attributes.get("lightning_ray.response") for s in spans}
    [planned] = calls_of(["planner"])
    assert text[planned.span_id] == plan.final_output
    solver_calls = calls_of(["solver"])
    assert [t.step for t in solver_calls] == list(range(len(solved.raw_responses)))  # numbered among its own calls
    assert text[solver_calls[-1].span_id] == solved.final_output
    assert len(transitions_from_spans(rollout, spans, "tiny-calc")) == 1 + len(solved.raw_responses)  # any agent
