"""A deterministic synthetic trace workload, shared by the store benchmarks on both sides.

Standard library only: it is imported from the project venv and from peers' venvs (.venvs/agentlightning), so that
every store ingests exactly the same data. Each span is a plain dict shaped like one recorded LLM call: about 20
attributes with OpenTelemetry GenAI semconv keys, a ~2 KB prompt, 500 prompt and 200 completion token ids and 200
logprobs (the token/logprob keys are lightning_ray/tracing/semconv.py's, spelled out here).
"""

from __future__ import annotations

import json
import random

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
PROMPT_TOKENS, COMPLETION_TOKENS, PROMPT_CHARS, COMPLETION_CHARS = 500, 200, 2048, 800
VOCAB = 151_000
WORDS = ("the agent calls a tool to read the file then it answers with the sum of all numbers found in column "
         "three and explains each step before giving a final result in plain text").split()


def _text(rng: random.Random, chars: int) -> str:
    words = rng.choices(WORDS, k=chars // 4)
    return " ".join(words)[:chars]


def _messages(rng: random.Random, chars: int) -> str:
    """A JSON chat transcript of exactly `chars` characters (gen_ai.input.messages is a JSON string)."""
    head = [{"role": "system", "parts": [{"type": "text", "content": "You are a helpful agent."}]},
            {"role": "user", "parts": [{"type": "text", "content": ""}]}]
    room = chars - len(json.dumps(head))
    head[1]["parts"][0]["content"] = _text(rng, room)
    return json.dumps(head)


def rollout_ids(rollouts: int) -> list[str]:
    return [f"ro-{k:06d}" for k in range(rollouts)]


def make_spans(n: int, rollouts: int = 100, seed: int = 0) -> list[dict]:
    """`n` LLM-call spans spread round-robin over `rollouts` rollouts (attempt "at-1" each), as concurrent rollouts
    would interleave them. Same arguments, same spans."""
    rng = random.Random(seed)
    ids = rollout_ids(rollouts)
    traces = {r: f"{rng.getrandbits(128):032x}" for r in ids}  # one trace per rollout ...
    roots = {r: f"{rng.getrandbits(64):016x}" for r in ids}    # ... whose root (agent) span parents its LLM calls
    t0 = 1_750_000_000.0
    spans = []
    for i in range(n):
        rid = ids[i % rollouts]
        start = t0 + i * 0.25
        prompt_ids = rng.choices(range(VOCAB), k=PROMPT_TOKENS)
        completion_ids = rng.choices(range(VOCAB), k=COMPLETION_TOKENS)
        spans.append({
            "span_id": f"{rng.getrandbits(64):016x}",
            "trace_id": traces[rid],
            "parent_id": roots[rid],
            "rollout_id": rid,
            "attempt_id": "at-1",
            "name": "llm.call",
            "start_time": start,
            "end_time": start + 0.2 + rng.random(),
            "attributes": {
                "gen_ai.operation.name": "chat",
                "gen_ai.provider.name": "openai",
                "gen_ai.request.model": MODEL,
                "gen_ai.response.model": MODEL,
                "gen_ai.request.temperature": 1.0,
                "gen_ai.request.top_p": 0.95,
                "gen_ai.request.max_tokens": COMPLETION_TOKENS,
                "gen_ai.request.seed": i,
                "gen_ai.response.id": f"chatcmpl-{i:08d}",
                "gen_ai.response.finish_reasons": ["length"],
                "gen_ai.usage.input_tokens": PROMPT_TOKENS,
                "gen_ai.usage.output_tokens": COMPLETION_TOKENS,
                "gen_ai.conversation.id": rid,
                "gen_ai.input.messages": _messages(rng, PROMPT_CHARS),
                "gen_ai.output.messages": _text(rng, COMPLETION_CHARS),
                "server.address": "127.0.0.1",
                "server.port": 8000,
                "lightning_ray.prompt_token_ids": prompt_ids,
                "lightning_ray.completion_token_ids": completion_ids,
                "lightning_ray.logprobs": [round(-3.0 * rng.random() ** 4, 6) for _ in range(COMPLETION_TOKENS)],
                "lightning_ray.policy_version": 0,
            },
        })
    return spans


if __name__ == "__main__":
    import sys
    import time

    t = time.perf_counter()
    spans = make_spans(int(sys.argv[1]) if len(sys.argv) > 1 else 1000)
    print(json.dumps({"spans": len(spans), "attributes": len(spans[0]["attributes"]),
                      "json_bytes_per_span": len(json.dumps(spans[0])), "seconds": round(time.perf_counter() - t, 2)}))
