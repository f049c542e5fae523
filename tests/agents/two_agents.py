"""An agent given by entry point (task.agent=tests.agents.two_agents:agent): a workflow of two agents, each a run of
the calc task's own agent: the drafter answers, then the solver answers again, and the solver's answer is the
workflow's. The drafter runs inside an OpenTelemetry GenAI agent span (gen_ai.agent.name) and its code names no
adapter: its calls reach its adapter by the header the platform's propagator adds (tracing/agent_header.py). The
solver, as an agent that sends no trace context would, names its adapter as the model (`<model>/solve`)."""

from functools import cache

import httpx
from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor

from lightning_ray.tasks import calc
from lightning_ray.tracing.otel import setup_otel


@cache
def _traced():
    """The process's tracer, and an HTTP client OpenTelemetry instruments, as an app's would be: its requests send
    the trace context (and the platform's propagator, the agent's name)."""
    provider = setup_otel()
    http_client = httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0))
    HTTPXClientInstrumentor.instrument_client(http_client, tracer_provider=provider)
    return provider.get_tracer(__name__), http_client


def agent(task: dict, base_url: str, model: str, api_key: str) -> str | None:
    tracer, http_client = _traced()
    with tracer.start_as_current_span("invoke_agent drafter", attributes={"gen_ai.agent.name": "drafter"}):
        calc.agent(task, base_url=base_url, model=model, api_key=api_key, http_client=http_client)
    return calc.agent(task, base_url=base_url, model=f"{model}/solve", api_key=api_key)
