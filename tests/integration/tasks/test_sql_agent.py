"""The sql task's LangGraph workflow, unchanged, against the real policy server: OpenLLMetry's LangChain/LangGraph
instrumentation names each agent's spans, OpenTelemetry's httpx instrumentation sends each call's traceparent, and
selection by agent name trains the writer and the rewriter while the checker's calls stay out."""

from __future__ import annotations

from collections import Counter

import pytest

from lightning_ray.algorithm.lightningrl import recorded_calls, transitions_from_spans
from lightning_ray.algorithm.select import Selection, agent_of
from lightning_ray.tasks import sql
from lightning_ray.tasks.sql.workflow import extract_sql
from lightning_ray.tracing import trace_attempt
from lightning_ray.types import Rollout

MODEL = "tiny-calc"


@pytest.fixture(scope="module")
def server(policy_app):
    # the schema in the prompt is ~900 of the tiny model's tokens: its rotary positions extend past 512
    with policy_app(engine={"max_model_len": 2048}, rollout={"temperature": 1.0, "max_tokens": 24}) as app:
        yield app


@pytest.fixture(scope="module")
def episodes(server):
    """Three questions answered by the workflow inside traced attempts, as a rollout worker runs them."""
    out = []
    for task in sql.make_tasks(3, seed=5):
        rid = server["store"].enqueue([task])[0].rollout_id
        base_url = server["url"] + f"/rollouts/{rid}/attempts/at-1/v1"
        with trace_attempt(rid, "at-1", server["store"].add_spans):
            answer = sql.agent(task.input, base_url, MODEL)
        out.append({"task": task, "rollout_id": rid, "answer": answer,
                    "spans": server["store"].query_spans([rid])})
    return out


def test_every_call_is_made_under_its_agent(episodes):
    for ep in episodes:
        spans = ep["spans"]
        by_id = {s.span_id: s for s in spans}
        calls = sorted(recorded_calls(spans), key=lambda s: s.start_time)
        agents = [agent_of(c, by_id) for c in calls]
        # writer first, then the checker after every query, a rewriter between checks; at most max_rounds rewrites
        assert agents[:2] == ["writer", "checker"]
        assert agents[2:] == ["rewriter", "checker"] * ((len(agents) - 2) // 2)
        assert agents.count("rewriter") <= ep["task"].input["max_rounds"]
        for c in calls:  # the server's span is in the client's trace: the agent's span is an ancestor, same trace
            parent = by_id[c.parent_id]
            assert parent.trace_id == c.trace_id and parent.rollout_id == ep["rollout_id"]
        # the checker ran each query read-only first, traced as a tool call
        tools = [s for s in spans if s.name == "execute_tool execute_sql"]
        assert len(tools) == agents.count("checker")


def test_selection_trains_the_writer_and_the_rewriter_but_not_the_checker(episodes):
    for ep in episodes:
        spans, by_id = ep["spans"], {s.span_id: s for s in ep["spans"]}
        rollout = Rollout(rollout_id=ep["rollout_id"], task=ep["task"], attempt_id="at-1",
                          reward=sql.reward(ep["task"].reward_input, ep["answer"]))
        trained = transitions_from_spans(rollout, spans, MODEL,
                                         select=Selection.of(MODEL, agents=["writer", "rewriter"]))
        made_by = Counter(agent_of(by_id[t.span_id], by_id) for t in trained)
        every = Counter(agent_of(c, by_id) for c in recorded_calls(spans))
        assert made_by == Counter({"writer": every["writer"], "rewriter": every["rewriter"]})
        assert every["checker"] >= 1 and "checker" not in made_by
        assert [t.step for t in trained] == list(range(len(trained)))  # steps numbered among the trained calls
        assert len(transitions_from_spans(rollout, spans, MODEL)) == sum(every.values())  # no selection: all


def test_the_answer_is_the_last_query_and_the_reward_is_its_execution_match(episodes):
    for ep in episodes:
        by_id = {s.span_id: s for s in ep["spans"]}
        query = None  # the writer's query, then each rewrite that has one: what the workflow's state ends with
        for c in sorted(recorded_calls(ep["spans"]), key=lambda s: s.start_time):
            written = extract_sql(c.attributes["lightning_ray.response"])
            if agent_of(c, by_id) == "writer":
                query = written
            elif agent_of(c, by_id) == "rewriter":
                query = written or query
        assert ep["answer"] == query
        task = ep["task"].reward_input
        assert sql.reward(task, task["gold"]) == 1.0 and sql.reward(task, "SELECT 1 WHERE 0") == 0.0
