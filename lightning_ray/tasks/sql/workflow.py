"""The SQL agent: a LangGraph workflow of three agents, written as it would be against OpenAI (langchain-openai's
ChatOpenAI on a base URL), knowing nothing of training.

    START -> writer -> checker --(the query ran and the checker approves it, or no rounds are left)--> END
                         ^    |
                         |    v  (otherwise)
                        rewriter

The writer drafts a query from the schema and the question; the checker runs it (read-only) and judges it by its
result or error; the rewriter rewrites it from the checker's feedback.

Each agent's turn is an OpenTelemetry span as the GenAI semantic conventions name it (`invoke_agent <name>`, with
gen_ai.agent.name), and OpenTelemetry's httpx instrumentation sends each model call's W3C traceparent, so the policy
server's record of the call nests under the agent that made it; selection by agent name (algorithm.select.agents)
then trains some agents and leaves the others' calls out. (OpenLLMetry's LangGraph instrumentation names a compiled
graph an agent, but the model calls of a graph run inside another graph's node nest under the outer node's spans,
beside the inner graph's agent span, not under it: the agents here would all be the outer graph.)
"""

from __future__ import annotations

import re
from typing import TypedDict

import httpx
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from opentelemetry import trace

from lightning_ray.tasks.sql.execution import QueryError, Result, execute
from lightning_ray.tasks.tls import tls_context
from lightning_ray.tracing import emit_tool

# One worked example on a schema of its own (not the task's): it shows a small model the form of the answer; without
# it SmolLM2-135M answered 0 of 16 held-out Chinook questions with a query that ran, with it 4 of 16.
WRITER_PROMPT = """You write SQLite queries. Given a database schema and a question, reply with one SQL query that \
answers it, in a ```sql block, and nothing else. Use only the tables and columns of the schema.

Example.
Schema:
Author(AuthorId, Name)
Book(BookId, Title, Year, AuthorId -> Author.AuthorId)

Question: How many books did Jane Austen write?

```sql
SELECT COUNT(*) FROM Book JOIN Author ON Book.AuthorId = Author.AuthorId WHERE Author.Name = 'Jane Austen'
```"""
CHECKER_PROMPT = ("You check SQLite queries. Given a question, a query and what the query returned, reply CORRECT if "
                  "the query answers the question. Otherwise reply WRONG and say in one sentence what to change.")
REWRITER_PROMPT = ("You fix SQLite queries. Given a database schema, a question, a query, what it returned and a "
                   "reviewer's feedback, reply with the corrected SQL query in a ```sql block, and nothing else.")
PREVIEW_ROWS = 5  # result rows the checker sees
PREVIEW_CHARS = 400
NO_TABLE_READ = "the query reads no table of the database"  # a tool error for AIR (run_query)

_CODE = re.compile(r"```(?:sql|sqlite)?\s*(.*?)(?:```|$)", re.DOTALL | re.IGNORECASE)
_QUERY = re.compile(r"\b(?:SELECT|WITH)\b.*", re.DOTALL | re.IGNORECASE)


class SQLState(TypedDict, total=False):
    question: str
    schema: str
    db: str  # the SQLite file's path
    sql: str  # the current query
    result: str  # what it returned (a preview) or its error, as the checker saw it
    ok: bool  # it ran without error
    verdict: str  # the checker's reply
    rounds: int  # rewrites so far


def build_workflow(llm: ChatOpenAI, max_rounds: int = 2, tracer=None):
    """The writer -> checker -> rewriter loop, at most `max_rounds` rewrites. `tracer`: an OpenTelemetry tracer for
    the agents' spans (None: the global provider's)."""
    tracer = tracer or trace.get_tracer(__name__)

    def ask(agent: str, system_prompt: str, text: str) -> str:
        with tracer.start_as_current_span(f"invoke_agent {agent}", attributes={
                "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": agent}):
            return str(llm.invoke([SystemMessage(system_prompt), HumanMessage(text)]).content)

    def write(state: SQLState) -> dict:
        reply = ask("writer", WRITER_PROMPT, f"Schema:\n{state['schema']}\n\nQuestion: {state['question']}")
        return {"sql": extract_sql(reply), "rounds": 0}

    def check(state: SQLState) -> dict:
        ok, result = run_query(state["db"], state["sql"])
        verdict = ask("checker", CHECKER_PROMPT,
                      f"Question: {state['question']}\n\nQuery:\n```sql\n{state['sql']}\n```\n\nResult:\n{result}")
        return {"ok": ok, "result": result, "verdict": verdict}

    def rewrite(state: SQLState) -> dict:
        reply = ask("rewriter", REWRITER_PROMPT,
                    f"Schema:\n{state['schema']}\n\nQuestion: {state['question']}\n\nQuery:\n```sql\n{state['sql']}"
                    f"\n```\n\nResult:\n{state['result']}\n\nFeedback: {state['verdict']}")
        return {"sql": extract_sql(reply) or state["sql"], "rounds": state["rounds"] + 1}

    def route(state: SQLState) -> str:
        done = state["ok"] and approves(state["verdict"])
        return END if done or state["rounds"] >= max_rounds else "rewriter"

    graph = StateGraph(SQLState)
    graph.add_node("writer", write)
    graph.add_node("checker", check)
    graph.add_node("rewriter", rewrite)
    graph.add_edge(START, "writer")
    graph.add_edge("writer", "checker")
    graph.add_conditional_edges("checker", route, ["rewriter", END])
    graph.add_edge("rewriter", "checker")
    return graph.compile(name="sql_agent")


def extract_sql(reply: str) -> str:
    """The query in a reply: its ```sql block, else the text from its first SELECT / WITH, else the whole reply."""
    if match := _CODE.search(reply):
        reply = match.group(1)
    elif match := _QUERY.search(reply):
        reply = match.group(0)
    return reply.strip()


def approves(verdict: str) -> bool:
    return verdict.strip().upper().startswith("CORRECT")


def run_query(db: str, sql: str) -> tuple[bool, str]:
    """Run the query read-only; a preview of its result, or its error, for the checker. Traced as a tool call,
    whose status AIR rewards: a query that reads no table of the database (`SELECT COUNT(*) - 1000000`) ran, but
    answers nothing: its span is an error, so that `tool_ok` cannot be earned without looking at the data."""
    try:
        result = execute(db, sql)
    except QueryError as e:
        emit_tool("execute_sql", sql, error=str(e))
        return False, f"error: {e}"
    text = preview(result)
    emit_tool("execute_sql", sql, text, error=None if result.tables else NO_TABLE_READ)
    return True, text




def preview(result: Result) -> str:
    lines = [" | ".join(result.columns)] + [" | ".join(map(str, row)) for row in result.rows[:PREVIEW_ROWS]]
    if len(result.rows) > PREVIEW_ROWS:
        lines.append(f"... {len(result.rows)} rows in all")
    elif not result.rows:
        lines.append("(no rows)")
    text = "\n".join(lines)
    return text if len(text) <= PREVIEW_CHARS else text[:PREVIEW_CHARS] + " ..."


def run(question: str, schema: str, db: str, base_url: str, model: str, api_key: str = "EMPTY",
        max_rounds: int = 2) -> str:
    """Answer the question with a query: the workflow's final one (approved, or the last rewrite)."""
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor

    from lightning_ray.tracing.otel import setup_otel  # the platform's span processor, where an app sets its exporter

    provider = setup_otel()
    with httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0), verify=tls_context()) as http_client:
        HTTPXClientInstrumentor.instrument_client(http_client, tracer_provider=provider)  # sends traceparent
        llm = ChatOpenAI(model=model, base_url=base_url, api_key=api_key, max_retries=0, http_client=http_client)
        workflow = build_workflow(llm, max_rounds, provider.get_tracer(__name__))
        # a round is a checker and a rewriter step; the recursion limit only backs max_rounds up
        state = workflow.invoke({"question": question, "schema": schema, "db": db},
                                {"recursion_limit": 4 + 2 * max_rounds})
    return state["sql"]
