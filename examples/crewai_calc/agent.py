"""The calculator task as a CrewAI crew of two agents, written as CrewAI users write it against OpenAI: a solver
that works the question out with a calculator tool, and a verifier that checks the solver's answer and states it.
Train the solver alone (the verifier's calls stay out of training):

    make train ARGS="task=calc_crewai 'algorithm.select.agents=[solver]'"

CrewAI pins openai 2 and pydantic 2.12 (the trainer has openai 3 and pydantic 2.14), so its rollout workers get their
own Ray runtime_env (configs/task/calc_crewai.yaml: the pins of envs/crewai/constraints.txt).

Agent names: CrewAI 1.15 makes GenAI `invoke_agent` spans of its own only for its hosted tracing, on a private
TracerProvider from its event bus's thread pool, and sends no traceparent with its model calls, so the policy
server's records cannot nest under them. Each agent's LLM therefore gets a CrewAI transport interceptor that opens an
`invoke_agent <role>` span (gen_ai.agent.name = the role) for every model call and sends its W3C traceparent.
"""

from __future__ import annotations

import re

import httpx
from crewai import LLM, Agent, Crew, Process, Task
from crewai.llms.hooks import BaseInterceptor
from crewai.tools import tool
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from lightning_ray.tasks.calc import calculate


@tool("calculator")
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses."""
    try:
        return str(calculate(expression))
    except (ValueError, SyntaxError) as e:
        return f"error: {e}"


class AgentSpans(BaseInterceptor[httpx.Request, httpx.Response]):
    """Names the agent behind each of one agent's model calls: an `invoke_agent <name>` span whose W3C traceparent
    goes with the request. The span ends as the request leaves (the transport hands the response back without its
    request, and a failed request none at all): it marks whose call it is, it does not time it."""

    def __init__(self, agent_name: str, tracer: trace.Tracer):
        self.agent_name, self.tracer = agent_name, tracer

    def on_outbound(self, message: httpx.Request) -> httpx.Request:
        with self.tracer.start_as_current_span(f"invoke_agent {self.agent_name}", attributes={
                "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": self.agent_name}):
            TraceContextTextMapPropagator().inject(message.headers)
        return message

    def on_inbound(self, message: httpx.Response) -> httpx.Response:
        return message

    async def aon_outbound(self, message: httpx.Request) -> httpx.Request:
        return self.on_outbound(message)

    async def aon_inbound(self, message: httpx.Response) -> httpx.Response:
        return message


def build_crew(base_url: str, model: str, api_key: str, tracer: trace.Tracer) -> Crew:
    def llm(agent_name: str) -> LLM:
        return LLM(model=f"openai/{model}", base_url=base_url, api_key=api_key, max_retries=0,
                   interceptor=AgentSpans(agent_name, tracer))

    solver = Agent(role="solver", goal="Work out arithmetic exactly, with the calculator tool.",
                   backstory="You never do arithmetic in your head: you call the calculator once with the whole "
                             "expression.", tools=[calculator], llm=llm("solver"), max_iter=3)
    verifier = Agent(role="verifier", goal="State the solver's result as the final answer, checked.",
                     backstory="You read the solver's work and state its number as ANSWER <number>.",
                     llm=llm("verifier"), max_iter=1)
    solve = Task(description="Calculate {question}", expected_output="The calculator's result.", agent=solver)
    verify = Task(description="Check the solver's result for {question} and state it.",
                  expected_output="ANSWER <number>", agent=verifier, context=[solve])
    return Crew(agents=[solver, verifier], tasks=[solve, verify], process=Process.sequential)


def agent(task: dict, base_url: str, model: str, api_key: str) -> str | None:
    """The rollout worker's entry point (task.agent): the final answer's number, as the task's scorer wants it."""
    from lightning_ray.tracing.otel import setup_otel  # the platform's span processor, where an app sets its exporter

    tracer = setup_otel().get_tracer(__name__)
    reply = str(build_crew(base_url, model, api_key, tracer).kickoff(inputs={"question": task["question"]}))
    # the number after the last ANSWER; without one, the reply's last number, its conclusion ("7 - 12 = -5")
    _, marker, tail = reply.rpartition("ANSWER")
    numbers = re.findall(r"-?\d+(?:\.\d+)?", tail)
    return (numbers[0] if marker else numbers[-1]) if numbers else None
