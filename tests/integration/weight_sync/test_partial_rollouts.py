"""serve.drain: what a weight update does with the generations in flight. `keep` (partial rollouts): they go on
under the new weights, and each call's span says which tokens each version produced; `abort`: they end at once with
an error the client retries. (`wait`, the synchronous default, is test_weight_sync's.) The HF engine here; vLLM's
`keep` is checked in test_vllm_engine."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from helpers import check_kept_generation, publish, stream_while_publishing

from lightning_ray.serving.engines import make_engine


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


def test_keep_updates_the_weights_under_a_running_call_and_its_span_says_which_tokens_are_whose(policy_app,
                                                                                                old_model):
    """Four choices of 400 tokens each, decoded together: the update is synced while they run, not after them, and no
    choice is cut; the ones the update landed in are recorded with both versions, each choice's tokens covered by its
    version spans."""
    new_state = {k: v * 1.05 if k == "lm_head.weight" else v for k, v in old_model.state_dict().items()}
    with policy_app(serve={"drain": "keep"}) as deployed:
        frames, spans, synced, ended = stream_while_publishing(
            deployed, lambda: publish(deployed["registry"], new_state, 1), 4)
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
        frames, spans, synced, _ = stream_while_publishing(
            deployed, lambda: publish(deployed["registry"], old_model.state_dict(), 1), 8)
    errors = [json.loads(f[6:])["error"] for f in frames if f.startswith("data: {") and '"error"' in f]
    assert errors and errors[0]["code"] == "weight_update", frames[-3:]
    assert synced < 30, synced
    assert len(spans) == 8 and all(s.status == "error" and s.attributes["error.type"] == "weight_update"
                                   for s in spans)
    generated = sorted(len(s.attributes["lightning_ray.completion_token_ids"]) for s in spans)
    assert generated[0] == 0 and generated[-1] > 0, generated
