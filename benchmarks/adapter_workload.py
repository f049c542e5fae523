"""Synthetic multi-agent traces for the adapter benchmark, in a neutral shape that each side turns into its own spans.

Standard library only: imported from the project venv (adapter_throughput.py) and from Agent Lightning's
(agl_adapter.py), so that both adapters see the same rollouts, calls, tokens and rewards. A rollout is one run of a
three-agent workflow (planner, then coder, then reviewer): a root span; per agent an agent span with several LLM
calls of the policy model under it, each followed by a tool call; a reward span at the end. An agent's conversation
grows as a chat agent's does (each prompt is the previous prompt + response + tool result), so prompts run from
256 to ~700 token ids; responses are 64-128 token ids with a logprob each. Same arguments, same rollouts.
"""

from __future__ import annotations

import json
import random
import statistics
import time

AGENTS = ("planner", "coder", "reviewer")
MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
TOOLS = ("read_file", "run_tests", "search_docs", "write_file")
SYSTEM_TOKENS, TOOL_TOKENS, RESPONSE_TOKENS = 256, 48, (64, 128)
VOCAB = 151_000
WORDS = ("the agent calls a tool to read the file then it answers with the sum of all numbers found in column "
         "three and explains each step before giving a final result in plain text").split()


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _text(rng: random.Random, tokens: int) -> str:
    """About four characters per token, like English under a BPE tokenizer."""
    return " ".join(rng.choices(WORDS, k=tokens))[: 4 * tokens]


def _hex(rng: random.Random, bits: int) -> str:
    return f"{rng.getrandbits(bits):0{bits // 4}x}"


def make_rollouts(rollouts: int = 64, calls: int = 4, seed: int = 0) -> list[dict]:
    """`rollouts` rollouts of len(AGENTS) agents x `calls` LLM calls each. A rollout: {"rollout_id", "reward",
    "spans"}; a span: {"kind": root|agent|llm|tool|reward, "span_id", "trace_id", "parent_id", "start", "end", ...}
    with the kind's own fields (an LLM call: agent, messages, response, prompt_ids, completion_ids, logprobs,
    response_id)."""
    rng = random.Random(seed)
    t = 1_750_000_000.0
    out = []
    for k in range(rollouts):
        trace = _hex(rng, 128)

        def span(kind: str, parent: str | None, start: float, end: float, **fields) -> dict:
            return {"kind": kind, "span_id": _hex(rng, 64), "trace_id": trace, "parent_id": parent, "start": start,
                    "end": end, **fields}

        root = span("root", None, t, t)
        spans = [root]
        for agent in AGENTS:
            agent_span = span("agent", root["span_id"], t, t, agent=agent)
            spans.append(agent_span)
            prompt = _ids(rng, SYSTEM_TOKENS)
            messages = [{"role": "system", "content": _text(rng, SYSTEM_TOKENS // 2)},
                        {"role": "user", "content": _text(rng, SYSTEM_TOKENS // 2)}]
            for c in range(calls):
                n = rng.randint(*RESPONSE_TOKENS)
                completion, response = _ids(rng, n), _text(rng, n)
                spans.append(span("llm", agent_span["span_id"], t, t + 0.3, agent=agent, messages=messages,
                                  response=response, prompt_ids=prompt, completion_ids=completion,
                                  logprobs=[round(-3.0 * rng.random() ** 4, 6) for _ in range(n)],
                                  response_id=f"chatcmpl-{k:06d}-{agent}-{c}"))
                tool, result = rng.choice(TOOLS), _text(rng, TOOL_TOKENS)
                call_id = f"call_{_hex(rng, 48)}"
                spans.append(span("tool", agent_span["span_id"], t + 0.31, t + 0.35, agent=agent, tool=tool,
                                  call_id=call_id, arguments=json.dumps({"path": f"src/{k}.py"}), result=result,
                                  ok=rng.random() > 0.1))
                t += 0.36
                prompt = prompt + completion + _ids(rng, TOOL_TOKENS)
                messages = messages + [{"role": "assistant", "content": response},
                                       {"role": "tool", "tool_call_id": call_id, "content": result}]
            agent_span["end"] = t
        reward = float(rng.random() < 0.5)
        spans.append(span("reward", root["span_id"], t, t, value=reward))
        root["end"] = t = t + 0.01
        out.append({"rollout_id": f"ro-{k:06d}", "reward": reward, "spans": spans})
    return out


def llm_calls(rollouts: list[dict]) -> int:
    return sum(s["kind"] == "llm" for r in rollouts for s in r["spans"])


def one_pass(run) -> tuple[int, float, float]:
    """Time `run()` (returns how many LLM calls it turned into training data) once: (its count, wall-clock seconds,
    this process's CPU seconds; the machine is shared: CPU time leaves out the time other processes held the core)."""
    t, c = time.perf_counter(), time.process_time()
    n = run()
    return n, time.perf_counter() - t, time.process_time() - c


def rates(side: str, measure: str, passes: list[tuple[int, float, float]], expected: int) -> dict:
    """The JSON line of a measurement from its timed passes: rates of the median pass in wall-clock and in CPU time,
    and of the fastest pass."""
    assert all(n == expected for n, _, _ in passes), f"{side} {measure}: {passes[0][0]} transitions, {expected} calls"
    wall, cpu = [w for _, w, _ in passes], [c for _, _, c in passes]
    return {"side": side, "measure": measure, "transitions": expected,
            "per_s": round(expected / statistics.median(wall), 1),
            "cpu_per_s": round(expected / statistics.median(cpu), 1), "best_per_s": round(expected / min(wall), 1),
            "median_s": round(statistics.median(wall), 4), "repeats": len(passes)}


def timed(side: str, measure: str, run, expected: int, repeats: int) -> dict:
    """One warm-up pass, then `repeats` timed passes of `run` alone; prints and returns the JSON line."""
    one_pass(run)
    line = rates(side, measure, [one_pass(run) for _ in range(repeats)], expected)
    print(json.dumps(line), flush=True)
    return line


if __name__ == "__main__":
    t0 = time.perf_counter()
    rs = make_rollouts()
    calls = [s for r in rs for s in r["spans"] if s["kind"] == "llm"]
    print(json.dumps({"rollouts": len(rs), "spans": sum(len(r["spans"]) for r in rs), "llm_calls": len(calls),
                      "prompt_tokens": [min(len(s["prompt_ids"]) for s in calls),
                                        max(len(s["prompt_ids"]) for s in calls)],
                      "seconds": round(time.perf_counter() - t0, 2)}))
