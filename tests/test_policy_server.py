"""The policy server on real Ray Serve with the HF engine, driven by the official openai client and raw HTTP."""

from __future__ import annotations

import httpx
import pytest
import ray
import torch
from openai import OpenAI
from ray import serve

from lightning_ray.serving.app import APP_NAME, deploy_policy
from lightning_ray.store.trace_store import TraceStore
from lightning_ray.training.weights import WeightRegistry

KEY = "test-key"
MODEL = "tiny-calc"
MESSAGES = [{"role": "user", "content": "What is 3 + 4?"}]


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_model_path, serve_port, tmp_path_factory):
    store = TraceStore.remote(str(tmp_path_factory.mktemp("store") / "traces.sqlite"))
    registry = WeightRegistry.remote()
    url = deploy_policy(str(tiny_model_path), MODEL, store, registry, port=serve_port, max_model_len=128, api_key=KEY)
    yield {"url": url, "store": store, "registry": registry}
    serve.delete(APP_NAME)


def client(server, path="/v1"):
    return OpenAI(base_url=server["url"] + path, api_key=KEY, max_retries=0)


def test_chat_completion_records_the_engines_token_ids(server):
    out = client(server, "/rollouts/ro-1/attempts/at-1/v1").chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, logprobs=True, seed=1)
    choice = out.choices[0]
    assert out.system_fingerprint == "lightning_ray-policy-v0"
    assert out.usage.completion_tokens == len(choice.token_ids) == len(choice.logprobs.content) > 0
    assert choice.finish_reason in ("stop", "length")
    [span] = ray.get(server["store"].get_spans.remote(["ro-1"]))
    assert span.attempt_id == "at-1"
    assert span.attributes["lightning_ray.completion_token_ids"] == choice.token_ids
    assert span.attributes["lightning_ray.prompt_token_ids"] == out.prompt_token_ids
    assert span.attributes["lightning_ray.logprobs"] == [t.logprob for t in choice.logprobs.content]


def test_seeded_sampling_repeats(server):
    a, b = (client(server).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, seed=7)
            for _ in range(2))
    assert a.choices[0].token_ids == b.choices[0].token_ids


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    ({"model": MODEL}, 400, "messages"),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ({"model": MODEL, "messages": MESSAGES, "temperature": 5}, 400, "temperature"),
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": 1000}, 400, None),  # over the context length
    ({"model": MODEL, "messages": MESSAGES, "stream": True}, 400, None),
    ({"model": "gpt-4o", "messages": MESSAGES}, 404, None),
])
def test_malformed_requests_get_openai_errors_and_the_server_keeps_serving(server, body, status, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server["url"] + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if param:
        assert error["param"] == param
    ok = client(server).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert ok.choices[0].message.role == "assistant"


def test_api_key_is_required_when_configured(server):
    r = httpx.post(server["url"] + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert httpx.get(server["url"] + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert [m.id for m in client(server).models.list().data] == [MODEL]


def test_published_weights_reach_the_replica(server, tiny_model_path):
    from transformers import AutoModelForCausalLM

    def greedy():
        out = client(server).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                                     logprobs=True)
        return out.system_fingerprint, [t.logprob for t in out.choices[0].logprobs.content]

    version_before, before = greedy()
    state = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).state_dict()
    state["lm_head.weight"] = state["lm_head.weight"] * 0.5  # flatter distribution: every logprob moves
    registry = server["registry"]
    ray.get(registry.publish.remote(1, [ray.put(state)]))
    ray.get(registry.wait_synced.remote(1, 60.0))
    version_after, after = greedy()
    assert (version_before, version_after) == ("lightning_ray-policy-v0", "lightning_ray-policy-v1")
    assert after != before
