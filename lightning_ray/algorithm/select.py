"""Which recorded calls are the policy's: those whose model and whose agent match the configured regexes, so one
agent of a multi-agent workflow, or several, is optimized without touching the workflow's code.

A call's agent is the nearest ancestor span (by parent_id, within the rollout's spans) that names an agent. The
policy server's LLM span hangs under the agent's spans through the W3C traceparent its client sent (serving/http.py);
a call made without one has no agent.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from lightning_ray.tracing import semconv
from lightning_ray.types import Span, Transition

# OpenLLMetry's agent spans before it wrote gen_ai.agent.name (CrewAI's "<role>.agent"): named by kind and entity.
_TRACELOOP_KIND, _TRACELOOP_ENTITY = "traceloop.span.kind", "traceloop.entity.name"


@dataclass(frozen=True)
class Selection:
    models: re.Pattern[str]
    agents: re.Pattern[str] | None  # None: any agent, and calls made under none

    @classmethod
    def of(cls, policy_model: str, models: list[str] | None = None, agents: list[str] | None = None) -> Selection:
        """Regexes, each matched against the whole name. No `models`: exactly the served policy model."""
        return cls(any_of(models or [re.escape(policy_model)]), any_of(agents) if agents else None)

    def calls(self, calls: Iterable[Span], spans: list[Span]) -> list[Span]:
        """The selected ones of `calls` (LLM spans), their agents looked up among `spans`, their rollout's."""
        calls = [c for c in calls if self.models.fullmatch(str(c.attributes.get(semconv.MODEL, "")))]
        if self.agents is None:
            return calls
        by_id = {s.span_id: s for s in spans}
        return [c for c in calls if (agent := agent_of(c, by_id)) is not None and self.agents.fullmatch(agent)]


def by_adapter(transitions: list[Transition]) -> dict[str | None, list[Transition]]:
    """Transitions by the adapter that served them, which trains on them (algorithm.adapters)."""
    pools: dict[str | None, list[Transition]] = {}
    for t in transitions:
        pools.setdefault(t.adapter, []).append(t)
    return pools


def any_of(patterns: list[str]) -> re.Pattern[str]:
    return re.compile("|".join(f"(?:{p})" for p in patterns))


def agent_name(span: Span) -> str | None:
    """The agent a span names: OpenTelemetry GenAI's gen_ai.agent.name (AutoGen; OpenLLMetry's LangGraph and CrewAI;
    OpenInference's and Pydantic AI's aliases, mapped to it on ingest), else an older OpenLLMetry agent span's."""
    return agent_named(span.name, span.attributes)


def agent_named(name: str, attributes: Mapping) -> str | None:
    """agent_name of a span's name and attributes (an OpenTelemetry span's too: its aliases not mapped yet)."""
    if agent := next((attributes[k] for k in (semconv.AGENT_NAME, *semconv.AGENT_NAME_ALIASES) if attributes.get(k)),
                     None):
        return str(agent)
    if attributes.get(_TRACELOOP_KIND) == "agent":
        return str(attributes.get(_TRACELOOP_ENTITY) or name.removesuffix(".agent"))
    return None


def agent_of(call: Span, by_id: dict[str, Span]) -> str | None:
    """The nearest ancestor's agent name; None when no ancestor names one (or the chain leaves the rollout)."""
    span = call
    for _ in range(len(by_id)):  # bounded: a client's spans could link into a cycle
        if span.parent_id is None or (span := by_id.get(span.parent_id)) is None:
            return None
        if (name := agent_name(span)) is not None:
            return name
    return None
