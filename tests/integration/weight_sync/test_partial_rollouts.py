"""serve.drain: what a weight update does with the generations in flight. `keep` (partial rollouts): they go on
under the new weights, and each call's span says which tokens each version produced; `abort`: they end at once with
an error the client retries. (`wait`, the synchronous default, is test_weight_sync's.) The HF engine here; vLLM's
`keep` is checked in test_vllm_engine."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import torch
from helpers import check_kept_generation, publish

from lightning_ray.serving.engines import make_engine

MODEL = "tiny-calc"


@pytest.fixture(scope="module")
def old_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def test_the_hf_engine_keeps_a_generation_going_across_a_weight_update(tiny_model_path, old_model):
    engine = make_engine("hf", str(tiny_model_path), max_model_len=512)
    loop = asyncio.new_event_loop()
    try:
        check_kept_generation(engine, old_model, loop.run_until_complete)
    finally:
        loop.close()


def stream_while_publishing(deployed, state: dict, n: int) -> tuple[list[str], list, float, float]:
    """Stream n choices of 400 tokens and publish version 1 once the first tokens are out (a frame with content: the
    first frames can come before any token, and a call aborted before its first token has nothing to record): the
    stream's frames, the call's spans, when the update was synced and when the stream ended (seconds from the
    publish)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "What is 3 + 4?"}], "max_tokens": 400,
            "ignore_eos": True, "n": n, "stream": True}
    rollout, frames, first, ended = deployed["new_rollout"](), [], threading.Event(), []

    def stream():
        with httpx.stream("POST", deployed["url"] + "/v1/chat/completions", json=body, timeout=120,
                          headers={"X-Rollout-Id": rollout}) as r:
            for line in r.iter_lines():
                frames.append(line)
                if not first.is_set() and line.startswith("data: {") and any(
                        c.get("delta", {}).get("content") for c in json.loads(line[6:]).get("choices", [])):
                    first.set()
        ended.append(time.time())

    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(30)
    start = time.time()
    publish(deployed["registry"], state, 1)
    synced = time.time() - start
    reader.join(120)
    return frames, deployed["store"].query_spans([rollout]), synced, ended[0] - start


def test_keep_updates_the_weights_under_a_running_call_and_its_span_says_which_tokens_are_whose(policy_app,
                                                                                                old_model):
    """Four choices of 400 tokens each, decoded together: the update is synced while they run, not after them, and no
    choice is cut; the ones the update landed in are recorded with both versions, each choice's tokens covered by its
    version spans."""
    new_state = {k: v * 1.05 if k == "lm_head.weight" else v for k, v in old_model.state_dict().items()}
    with policy_app(serve={"drain": "keep"}) as deployed:
        frames, spans, synced, ended = stream_while_publishing(deployed, new_state, 4)
    assert "data: [DONE]" in frames and not any('"error"' in f for f in frames), frames[-3:]
    assert synced < ended, (synced, ended)  # the update did not wait for the call
    assert len(spans) == 4
    versions = set()
    for s in spans:
        a = s.attributes
        runs = a["lightning_ray.policy_version_spans"]
        assert len(a["lightning_ray.completion_token_ids"]) == 400 and a["gen_ai.response.finish_reasons"] == ["length"]
        assert runs[0][1] == 0 and runs[-1][2] == 400 and all(x[2] == y[1] for x, y in zip(runs, runs[1:])), runs
        assert a["lightning_ray.policy_version"] == runs[0][0]  # the oldest
        versions |= {v for v, _, _ in runs}
    assert versions == {0, 1}  # the update landed while the call ran


def test_abort_ends_the_calls_in_flight_at_once(policy_app, old_model):
    """The stream ends with a 503-style error frame the client can retry, the update goes through at once (not at the
    60 s drain deadline), and each choice is recorded as an errored call, never trained: with what it had generated,
    or with no tokens where it had not begun (here the 4 choices the engine's batch has no room for; so does a call
    that is not streamed, whose engine gives its tokens at the end)."""
    with policy_app(serve={"drain": "abort"}, engine={"max_num_seqs": 4}) as deployed:
        frames, spans, synced, _ = stream_while_publishing(deployed, old_model.state_dict(), 8)
    errors = [json.loads(f[6:])["error"] for f in frames if f.startswith("data: {") and '"error"' in f]
    assert errors and errors[0]["code"] == "weight_update", frames[-3:]
    assert synced < 30, synced
    assert len(spans) == 8 and all(s.status == "error" and s.attributes["error.type"] == "weight_update"
                                   for s in spans)
    generated = sorted(len(s.attributes["lightning_ray.completion_token_ids"]) for s in spans)
    assert generated[0] == 0 and generated[-1] > 0, generated
