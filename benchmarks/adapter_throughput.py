"""Adapter throughput: transitions per second from stored spans to training data, ours vs Agent Lightning 0.3.0's
trace-to-triplet adapter, on the same synthetic multi-agent traces (adapter_workload.py), in one run.

    .venv/bin/python benchmarks/adapter_throughput.py [--rollouts 64] [--calls 4] [--repeats 5] [--no-peer] [--out F]

Ours: the spans as our stack stores them (the policy server's LLM-call spans with origin "server" and the attributes
serving/app.py records; agent, tool and reward spans from the client) in a SQLite trace store in a temporary run
directory (the store actor's backend, called in this process: no Ray hop), the rollouts finished there with their
rewards. Timed as the trainer's adapt phase does it: "read+adapt" = `query_spans(rollout ids)` of the spans the default
configuration adapts (lightningrl.spans_read: the calls and rewards) + LightningRL's `adapt` (transition level);
"read+adapt[agents]" = the same with the calls selected by agent (algorithm.select.agents naming all three), which reads
every span (theirs: their read+adapt again, beside it); "adapt" = `adapt` alone on the spans already read;
"adapt[trajectory]" = adapt with each agent's calls merged where the tokens allow (ours only). Theirs (agl_adapter.py in
.venvs/agentlightning, built by envs/agentlightning/build.sh, kept running beside this process): per rollout, their
store's `query_spans` + `TracerTraceToTriplet().adapt`, as their verl daemon does, and the adapter alone. Each
measurement: one warm-up pass per side, then `repeats` passes per side taken in turns (the machine's load drifts: both
sides see the same drift); rates of the median pass in wall-clock and in CPU time (adapter_workload.rates, shared by
both sides). Prints one JSON line per measurement, then one with both rates and the ratios ours / theirs, and the load
average before and after; `--out` also writes them all to a JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from adapter_workload import MODEL, llm_calls, make_rollouts, one_pass, rates, timed  # noqa: E402

from lightning_ray.algorithm.lightningrl import adapt, spans_read  # noqa: E402
from lightning_ray.algorithm.select import Selection  # noqa: E402
from lightning_ray.store.rows import span_row  # noqa: E402
from lightning_ray.store.sqlite import SQLiteBackend  # noqa: E402
from lightning_ray.tracing import semconv  # noqa: E402
from lightning_ray.types import Rollout, Span, Task  # noqa: E402

PEER_PYTHON = HERE.parent / ".venvs/agentlightning/bin/python"
SIDE, PEER = "lightning_ray", "agentlightning"


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


def ours(backend: SQLiteBackend, rollouts: list[dict], repeats: int) -> tuple[dict, dict]:
    """The store filled (untimed); our timed runs by measure, and the trajectory-level line (ours only)."""
    finished = stored(backend, rollouts)
    ids = [r.rollout_id for r in finished]
    names = spans_read(Selection.of(MODEL), air=False)  # the default configuration's read: calls and rewards
    agents = Selection.of(MODEL, agents=sorted({s["agent"] for r in rollouts for s in r["spans"] if "agent" in s}))
    spans = backend.query_spans(ids, name=names)
    runs = {"read+adapt": lambda: len(adapt(finished, backend.query_spans(ids, name=names), MODEL)[0]),
            "read+adapt[agents]": lambda: len(adapt(finished, backend.query_spans(ids, name=spans_read(agents, False)),
                                                    MODEL, select=agents)[0]),
            "adapt": lambda: len(adapt(finished, spans, MODEL)[0])}
    # trajectory level: counted in calls taken in; the calls of one agent extend each other's tokens, and every
    # agent starts a new conversation, so each agent's calls become one sequence
    sequences = len(rollouts) * len({s["agent"] for r in rollouts for s in r["spans"] if s["kind"] == "agent"})

    def trajectory() -> int:
        merged, stats = adapt(finished, spans, MODEL, "trajectory")
        assert len(merged) == sequences, f"{len(merged)} sequences, expected {sequences}"
        return stats["policy_calls"]

    return runs, timed(SIDE, "adapt[trajectory]", trajectory, llm_calls(rollouts), repeats)


class Peer:
    """Agent Lightning's side in its own venv, one timed pass per request, so that its passes interleave with ours."""

    def __init__(self, args):
        # idempotent: builds .venvs/agentlightning (~5 min) unless its .installed stamp is there
        subprocess.run(["bash", str(HERE.parent / "envs/agentlightning/build.sh")], check=True)
        self.proc = subprocess.Popen([str(PEER_PYTHON), str(HERE / "agl_adapter.py"), "--serve", "--rollouts",
                                      str(args.rollouts), "--calls", str(args.calls)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._reply()  # its store is filled

    def one_pass(self, measure: str) -> tuple[int, float, float]:
        self.proc.stdin.write(measure + "\n")
        self.proc.stdin.flush()
        r = self._reply()
        return r["n"], r["wall"], r["cpu"]

    def _reply(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"agl_adapter.py exited ({self.proc.wait()})")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def interleaved(runs: dict, peer: Peer, expected: int, repeats: int) -> list[dict]:
    """Per measure: one warm-up pass each, then `repeats` passes of each side in turns (ours, theirs, theirs, ours,
    ...): a change in the machine's load lands on both sides alike."""
    lines = []
    for measure, run in runs.items():
        theirs = measure.split("[")[0]  # they read every span whatever they train on
        sides = {SIDE: lambda: one_pass(run), PEER: lambda: peer.one_pass(theirs)}
        passes = {side: [] for side in sides}
        for side in sides:
            sides[side]()
        for i in range(repeats):
            for side in (SIDE, PEER) if i % 2 == 0 else (PEER, SIDE):
                passes[side].append(sides[side]())
        for side in sides:
            lines.append(rates(side, measure, passes[side], expected))
            print(json.dumps(lines[-1]), flush=True)
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rollouts", type=int, default=64)
    p.add_argument("--calls", type=int, default=4, help="LLM calls per agent (3 agents per rollout)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-peer", action="store_true", help="skip Agent Lightning")
    p.add_argument("--out", help="also write every measurement and the summary to this JSON file")
    args = p.parse_args()

    load = os.getloadavg()[0]
    rollouts = make_rollouts(args.rollouts, args.calls)
    expected = llm_calls(rollouts)
    with tempfile.TemporaryDirectory() as run_dir:
        backend = SQLiteBackend(Path(run_dir) / "store.sqlite")
        runs, trajectory = ours(backend, rollouts, args.repeats)
        if args.no_peer:
            for measure, run in runs.items():
                timed(SIDE, measure, run, expected, args.repeats)
            return
        peer = Peer(args)
        try:
            lines = [*interleaved(runs, peer, expected, args.repeats), trajectory]
        finally:
            peer.close()
            backend.db.close()
    by = {(line["side"], line["measure"]): line for line in lines}

    def versus(measure: str) -> dict:
        mine, theirs = by[SIDE, measure], by[PEER, measure]
        return {"ours_per_s": mine["per_s"], "theirs_per_s": theirs["per_s"],
                "ratio": round(mine["per_s"] / theirs["per_s"], 2),
                "cpu_ratio": round(mine["cpu_per_s"] / theirs["cpu_per_s"], 2)}

    summary = {"benchmark": "adapter_throughput", "rollouts": args.rollouts, "transitions": expected,
               "repeats": args.repeats, **versus("read+adapt"), "agent_selection": versus("read+adapt[agents]"),
               "adapt_only": versus("adapt"),
               "load_avg": [round(load, 2), round(os.getloadavg()[0], 2)]}
    print(json.dumps(summary), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "measurements": lines}, indent=2) + "\n")


if __name__ == "__main__":
    main()
