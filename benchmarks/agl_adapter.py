"""Agent Lightning 0.3.0's trace-to-triplet adapter on the shared workload (adapter_workload.py): the peer side of the
adapter benchmark. Runs in Agent Lightning's own venv, not the project's:

    bash envs/agentlightning/build.sh
    .venvs/agentlightning/bin/python benchmarks/agl_adapter.py [--rollouts N] [--calls N] [--repeats N] [--serve]

The spans are shaped as their tracer records them: the LLM call as AgentOps' `openai.chat.completion` span with the
token ids and logprobs their instrumentation adds (prompt_token_ids, response_token_ids, logprobs.content), the chat
flattened into gen_ai.prompt.N.* / gen_ai.completion.0.*; the agent's span with `agent.name`; the reward as
`emit_reward` writes it. They go into an InMemoryLightningStore (untimed). Timed, as their verl daemon does it per
finished rollout (`_validate_data_v1`): `query_spans(rollout_id, attempt_id="latest")` then
`TracerTraceToTriplet().adapt(spans)` (the daemon's default adapter); "adapt" times the adapter alone on spans
already read. Timed by adapter_workload, as our side is; prints one JSON line per measurement. With --serve (how
adapter_throughput.py drives it, so that the two sides' passes interleave), it prints {"ready": true}, then times one
pass per measure named on stdin and answers with a JSON line {"n", "wall", "cpu"}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm (imported by agentlightning) must not fetch

from agentlightning import Span, TracerTraceToTriplet  # noqa: E402
from agentlightning.emitter.reward import emit_reward  # noqa: E402
from agentlightning.store import InMemoryLightningStore  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from adapter_workload import MODEL, WORDS, llm_calls, make_rollouts, one_pass, timed  # noqa: E402

SIDE = "agentlightning"


def llm_attributes(s: dict) -> dict:
    """What AgentOps' OpenAI instrumentation, patched by Agent Lightning, records for one chat completion."""
    attrs = {"gen_ai.system": "OpenAI", "gen_ai.request.model": MODEL, "gen_ai.request.temperature": 1.0,
             "gen_ai.request.max_tokens": 512, "gen_ai.response.model": MODEL, "gen_ai.response.id": s["response_id"],
             "gen_ai.usage.prompt_tokens": len(s["prompt_ids"]),
             "gen_ai.usage.completion_tokens": len(s["completion_ids"]),
             "llm.usage.total_tokens": len(s["prompt_ids"]) + len(s["completion_ids"])}
    for i, m in enumerate(s["messages"]):
        attrs[f"gen_ai.prompt.{i}.role"] = m["role"]
        attrs[f"gen_ai.prompt.{i}.content"] = m["content"]
    attrs.update({"gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": s["response"],
                  "gen_ai.completion.0.finish_reason": "stop", "prompt_token_ids": s["prompt_ids"],
                  "response_token_ids": s["completion_ids"]})
    tokens = [WORDS[i % len(WORDS)] for i in s["completion_ids"]]
    attrs["logprobs.content"] = json.dumps([{"token": tok, "bytes": list(tok.encode()), "logprob": lp,
                                             "top_logprobs": []} for tok, lp in zip(tokens, s["logprobs"])])
    return attrs


def agl_span(s: dict, rollout_id: str, attempt_id: str, seq: int) -> Span:
    kind = s["kind"]
    if kind == "llm":
        name, attrs = "openai.chat.completion", llm_attributes(s)
    elif kind == "agent":
        name, attrs = f"agent {s['agent']}", {"agent.name": s["agent"]}
    elif kind == "tool":
        name, attrs = f"{s['tool']}.tool", {"gen_ai.tool.name": s["tool"], "gen_ai.tool.call.id": s["call_id"],
                                           "gen_ai.tool.call.arguments": s["arguments"],
                                           "gen_ai.tool.call.result": s["result"]}
    elif kind == "reward":
        core = emit_reward(s["value"], propagate=False)  # their own reward span shape
        name, attrs = core.name, dict(core.attributes)
    else:
        name, attrs = "workflow", {}
    return Span.from_attributes(attributes=attrs, rollout_id=rollout_id, attempt_id=attempt_id, sequence_id=seq,
                                name=name, trace_id=s["trace_id"], span_id=s["span_id"], parent_id=s["parent_id"],
                                start_time=s["start"], end_time=s["end"])


async def stored(rollouts: list[dict]) -> tuple[InMemoryLightningStore, list[str]]:
    """Untimed: each rollout started in a fresh store, its spans added, its attempt marked succeeded."""
    store, ids = InMemoryLightningStore(), []
    for r in rollouts:
        attempted = await store.start_rollout(input={"task": r["rollout_id"]})
        rid, aid = attempted.rollout_id, attempted.attempt.attempt_id
        await store.add_many_spans([agl_span(s, rid, aid, i + 1) for i, s in enumerate(r["spans"])])
        await store.update_attempt(rid, aid, status="succeeded")
        ids.append(rid)
    return store, ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rollouts", type=int, default=64)
    p.add_argument("--calls", type=int, default=4, help="LLM calls per agent")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--serve", action="store_true", help="one timed pass per measure named on stdin")
    args = p.parse_args()

    rollouts = make_rollouts(args.rollouts, args.calls)
    loop = asyncio.new_event_loop()  # the store is async; each timed pass runs to completion on this loop
    store, ids = loop.run_until_complete(stored(rollouts))
    adapter = TracerTraceToTriplet()

    async def read_and_adapt() -> int:
        return sum([len(adapter.adapt(await store.query_spans(rid, attempt_id="latest"))) for rid in ids])

    spans = [loop.run_until_complete(store.query_spans(rid, attempt_id="latest")) for rid in ids]
    runs = {"read+adapt": lambda: loop.run_until_complete(read_and_adapt()),
            "adapt": lambda: sum(len(adapter.adapt(s)) for s in spans)}
    if args.serve:
        print(json.dumps({"ready": True}), flush=True)
        for measure in sys.stdin:
            n, wall, cpu = one_pass(runs[measure.strip()])
            print(json.dumps({"n": n, "wall": wall, "cpu": cpu}), flush=True)
        return
    for measure, run in runs.items():
        timed(SIDE, measure, run, llm_calls(rollouts), args.repeats)


if __name__ == "__main__":
    main()
