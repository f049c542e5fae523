"""Adapter throughput: transitions per second from stored spans to training data, ours vs Agent Lightning 0.3.0's
trace-to-triplet adapter, on the same synthetic multi-agent traces (adapter_workload.py), in one run.

    .venv/bin/python benchmarks/adapter_throughput.py [--rollouts 64] [--calls 4] [--repeats 5] [--no-peer]

Ours: the spans as our stack stores them (the policy server's LLM-call spans with origin "server" and the attributes
serving/app.py records; agent, tool and reward spans from the client) in a SQLite trace store in a temporary run
directory (the store actor's backend, called in this process: no Ray hop), the rollouts finished there with their
rewards. Timed as the trainer's adapt phase does it: "read+adapt" = `query_spans(rollout ids)` + LightningRL's
`adapt` (transition level); "adapt" = `adapt` alone on the spans already read; "adapt[trajectory]" = adapt with
each agent's calls merged where the tokens allow. Theirs (agl_adapter.py in .venvs/agentlightning, built by
envs/agentlightning/build.sh): per rollout, their store's `query_spans` + `TracerTraceToTriplet().adapt`, as their
verl daemon does, and the adapter alone. Each measurement: one warm-up pass, then the median of `repeats` passes.
Prints one JSON line per measurement, then one with both rates and the ratio ours / theirs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from adapter_workload import MODEL, llm_calls, make_rollouts  # noqa: E402

from lightning_ray.algorithm.lightningrl import adapt  # noqa: E402
from lightning_ray.store.sqlite import SQLiteBackend, span_row  # noqa: E402
from lightning_ray.tracing import semconv  # noqa: E402
from lightning_ray.types import Rollout, Span, Task  # noqa: E402

PEER_PYTHON = HERE.parent / ".venvs/agentlightning/bin/python"


def our_span(s: dict, rollout_id: str, attempt_id: str) -> tuple[Span, str]:
    """The span as our stack stores it, and its origin."""
    kind, common = s["kind"], {"span_id": s["span_id"], "trace_id": s["trace_id"], "parent_id": s["parent_id"],
                               "rollout_id": rollout_id, "attempt_id": attempt_id, "start_time": s["start"],
                               "end_time": s["end"]}
    if kind == "llm":  # as serving/app.py records a chat call
        return Span(name=semconv.LLM_CALL, status="ok", **common, attributes={
            "lightning_ray.request": {"messages": s["messages"], "temperature": 1.0, "max_tokens": 512},
            semconv.OPERATION: "chat", semconv.MODEL: MODEL, semconv.POLICY_VERSION: 0,
            semconv.PROMPT_TOKEN_IDS: s["prompt_ids"], semconv.COMPLETION_TOKEN_IDS: s["completion_ids"],
            semconv.LOGPROBS: s["logprobs"],
            semconv.SAMPLING: {"temperature": 1.0, "top_p": 1.0, "seed": None, "constrained": False},
            "gen_ai.response.finish_reasons": ["stop"], "lightning_ray.response": s["response"],
            "lightning_ray.choice_index": 0, "lightning_ray.error": None, "lightning_ray.replica": "policy#0",
        }), "server"
    if kind == "agent":
        return Span(name=f"invoke_agent {s['agent']}", **common,
                    attributes={semconv.OPERATION: "invoke_agent", semconv.AGENT_NAME: s["agent"]}), "client"
    if kind == "tool":
        return Span(name=f"{semconv.EXECUTE_TOOL} {s['tool']}", status="ok" if s["ok"] else "error", **common,
                    attributes={semconv.OPERATION: semconv.EXECUTE_TOOL, semconv.TOOL_NAME: s["tool"],
                                semconv.TOOL_CALL_ID: s["call_id"], semconv.TOOL_CALL_ARGUMENTS: s["arguments"],
                                semconv.TOOL_CALL_RESULT: s["result"]}), "client"
    if kind == "reward":
        return Span(name=semconv.REWARD, **common, attributes={semconv.REWARD_VALUE: s["value"]}), "client"
    return Span(name=semconv.ROLLOUT, **common), "client"


def stored(backend: SQLiteBackend, rollouts: list[dict]) -> list[Rollout]:
    """Untimed: the rollouts queued, leased and finished with their rewards; their spans stored as the policy server
    (origin "server") and the client (the rest) send them."""
    backend.enqueue([Rollout(rollout_id=r["rollout_id"], task=Task(task_id=f"task-{i // 8}", input={}))
                     for i, r in enumerate(rollouts)])
    finished = []
    for r in rollouts:
        leased, attempt = backend.dequeue("w0", time.time())
        assert leased.rollout_id == r["rollout_id"]
        for origin in ("server", "client"):
            rows = [span_row(span) for span, o in (our_span(s, leased.rollout_id, attempt.attempt_id)
                                                   for s in r["spans"]) if o == origin]
            backend.add_span_rows(rows, origin=origin)
        finished.append(backend.finish_attempt(attempt.attempt_id, "succeeded", time.time(), reward=r["reward"]))
    return finished


def measure(name: str, run, expected: int, repeats: int) -> dict:
    seconds = []
    for i in range(repeats + 1):  # the first pass warms up
        t = time.perf_counter()
        n = run()
        if i:
            seconds.append(time.perf_counter() - t)
    assert n == expected, f"{n} transitions from {expected} LLM calls"
    line = {"side": "lightning_ray", "measure": name, "transitions": n,
            "per_s": round(n / statistics.median(seconds), 1), "best_per_s": round(n / min(seconds), 1),
            "median_s": round(statistics.median(seconds), 4), "repeats": repeats}
    print(json.dumps(line), flush=True)
    return line


def ours(args, rollouts: list[dict]) -> list[dict]:
    expected = llm_calls(rollouts)
    with tempfile.TemporaryDirectory() as run_dir:
        backend = SQLiteBackend(Path(run_dir) / "store.sqlite")
        finished = stored(backend, rollouts)
        ids = [r.rollout_id for r in finished]
        spans = backend.query_spans(ids)
        out = [
            measure("read+adapt", lambda: len(adapt(finished, backend.query_spans(ids), MODEL)[0]), expected,
                    args.repeats),
            measure("adapt", lambda: len(adapt(finished, spans, MODEL)[0]), expected, args.repeats),
        ]
        # trajectory level: counted in calls taken in; the calls of one agent extend each other's tokens, and every
        # agent starts a new conversation, so each agent's calls become one sequence
        sequences = len(rollouts) * len({s["agent"] for r in rollouts for s in r["spans"] if s["kind"] == "agent"})

        def trajectory() -> int:
            merged, stats = adapt(finished, spans, MODEL, "trajectory")
            assert len(merged) == sequences, f"{len(merged)} sequences, expected {sequences}"
            return stats["policy_calls"]

        out.append(measure("adapt[trajectory]", trajectory, expected, args.repeats))
        backend.db.close()
    return out


def peer(args) -> list[dict]:
    # idempotent: builds .venvs/agentlightning (~5 min) unless its .installed stamp is there
    subprocess.run(["bash", str(HERE.parent / "envs/agentlightning/build.sh")], check=True)
    run = subprocess.run([str(PEER_PYTHON), str(HERE / "agl_adapter.py"), "--rollouts", str(args.rollouts),
                          "--calls", str(args.calls), "--repeats", str(args.repeats)], capture_output=True, text=True,
                         check=True)
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    for line in lines:
        print(json.dumps(line), flush=True)
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rollouts", type=int, default=64)
    p.add_argument("--calls", type=int, default=4, help="LLM calls per agent (3 agents per rollout)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-peer", action="store_true", help="skip Agent Lightning")
    args = p.parse_args()

    rollouts = make_rollouts(args.rollouts, args.calls)
    mine = {line["measure"]: line["per_s"] for line in ours(args, rollouts)}
    if args.no_peer:
        return
    theirs = {line["measure"]: line["per_s"] for line in peer(args)}
    print(json.dumps({
        "benchmark": "adapter_throughput", "rollouts": args.rollouts, "transitions": llm_calls(rollouts),
        "repeats": args.repeats,
        "ours_per_s": mine["read+adapt"], "theirs_per_s": theirs["read+adapt"],
        "ratio": round(mine["read+adapt"] / theirs["read+adapt"], 2),
        "adapt_only": {"ours_per_s": mine["adapt"], "theirs_per_s": theirs["adapt"],
                       "ratio": round(mine["adapt"] / theirs["adapt"], 2)},
    }), flush=True)


if __name__ == "__main__":
    main()
