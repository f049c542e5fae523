"""Agents hold their own credential: with serve.api_key set, the key an agent gets reaches the policy and its own
attempt's spans, and nothing else (no finishing, queueing or reading tasks and their answers); only the worker that
holds a lease ends its attempt. Real Ray, Serve (the policy and the store API behind one key), SQLite, the openai
client and the HTTP LightningClient."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
from google.protobuf.json_format import MessageToJson
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

from lightning_ray import auth
from lightning_ray.client import LightningClient
from lightning_ray.config.schema import EmbeddingsConfig
from lightning_ray.rollout.runner import run_attempt
from lightning_ray.tasks import calc
from lightning_ray.tracing import semconv
from lightning_ray.types import AttemptPolicy, Task
from helpers import agent_otel_spans

KEY = "sk-operator-0123456789"
MODEL = "tiny-calc"


@pytest.fixture(scope="module")
def app(policy_app, serve_port):
    from lightning_ray.serving.deploy import delete_apps
    from lightning_ray.store.http import APP_NAME, deploy_store_api

    with policy_app(serve={"api_key": KEY}, rollout={"max_tokens": 8}) as app:
        url = deploy_store_api(app["store"], port=serve_port, api_key=KEY)
        yield {**app, "store_url": url}
        delete_apps([APP_NAME])


def lease(store, rollout_id: str):
    """Dequeue until this rollout is leased (the fixture's store may hold other tests' rollouts)."""
    leased = store.dequeue("w")
    while leased.rollout_id != rollout_id:
        leased = store.dequeue("w")
    return leased


def refused(r: httpx.Response) -> tuple[int, str]:
    """A refusal's status and code, with its OpenAI-style body checked."""
    error = r.json()["error"]
    assert error["message"] and error["type"] and set(error) == {"message", "type", "param", "code"}, r.text
    return r.status_code, error["code"]


def test_an_agents_key_reaches_the_policy_and_its_own_spans_only(app):
    store = app["store"]
    [task] = calc.make_tasks(1, seed=0)
    [mine] = store.enqueue([task], AttemptPolicy(unresponsive_seconds=30))
    leased = lease(store, mine.rollout_id)
    [other] = store.enqueue([Task(task_id="other", input={"question": "q"}, reference={"answer": "42"})])
    seen: dict = {}

    def agent(task_input: dict, base_url: str, model: str, api_key: str) -> str:
        """An agent that tries everything its key might open; it answers with the model's reply."""
        seen.update(task_input=task_input, api_key=api_key)
        rid, aid = re.search(r"/rollouts/([^/]+)/attempts/([^/]+)/v1$", base_url).groups()
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        seen["models"] = [m.id for m in client.models.list()]
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is 3+4?"}])
        policy = httpx.Client(base_url=base_url.removesuffix(f"/rollouts/{rid}/attempts/{aid}/v1"), timeout=30,
                              headers={"Authorization": f"Bearer {api_key}"})
        http = httpx.Client(base_url=app["store_url"], headers={"Authorization": f"Bearer {api_key}"}, timeout=30)
        own = {"name": "agent.step", "rollout_id": rid, "attempt_id": aid}
        hello = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        _, foreign_otlp = agent_otel_spans(other.rollout_id, "at-x")
        _, own_otlp = agent_otel_spans(rid, aid)
        seen["tries"] = {
            "finish": http.post(f"/v1/rollouts/{rid}/attempts/{aid}/finish", json={"status": "succeeded", "reward": 1}),
            "heartbeat": http.post(f"/v1/rollouts/{rid}/attempts/{aid}/heartbeat"),
            "enqueue": http.post("/v1/rollouts", json={"tasks": [{"task_id": "x", "input": {}}]}),
            "dequeue": http.post("/v1/rollouts/dequeue", json={}),
            "dequeue a batch": http.post("/v1/rollouts/dequeue_batch", json={"attempt_ids": ["at-x"]}),
            "finish a batch": http.post("/v1/rollouts/finish", json={"verdicts": [
                {"rollout_id": rid, "attempt_id": aid, "status": "succeeded", "reward": 1}]}),
            "cancel": http.post("/v1/rollouts/cancel", json={"rollout_ids": [other.rollout_id]}),
            "read own task": http.get(f"/v1/rollouts/{rid}"),
            "read another task": http.get(f"/v1/rollouts/{other.rollout_id}"),
            "list tasks": http.get("/v1/rollouts"),
            "read attempts": http.get(f"/v1/rollouts/{rid}/attempts"),
            "read spans": http.get("/v1/spans", params={"rollout_id": rid}),
            "stats": http.get("/v1/stats"),
            "another's spans": http.post("/v1/spans", json={"spans": [{**own, "rollout_id": other.rollout_id}]}),
            "another's OTLP spans": http.post("/v1/traces", content=MessageToJson(encode_spans(foreign_otlp)),
                                              headers={"content-type": "application/json"}),
            "another rollout's policy": policy.post(f"/rollouts/{other.rollout_id}/attempts/{aid}/v1/chat/completions",
                                                    json=hello),
            "no rollout named, another attempt": policy.post("/v1/chat/completions", json=hello,
                                                             headers={"X-Attempt-Id": "at-other"}),
            "health": policy.get("/health"),
            "a made-up key": httpx.get(f"{base_url}/models", headers={"Authorization": f"Bearer {api_key}0"}),
            # a base URL given /v1 twice: a path not there (it was refused as beyond the key)
            "a path not there": policy.post(f"/rollouts/{rid}/attempts/{aid}/v1/v1/chat/completions", json=hello),
        }
        seen["own spans"] = http.post("/v1/spans", json={"spans": [own]})
        seen["own OTLP spans"] = http.post("/v1/traces", content=MessageToJson(encode_spans(own_otlp)),
                                           headers={"content-type": "application/json"})
        return reply.choices[0].message.content

    run_attempt(store, leased, agent, calc.reward, app["url"], MODEL, api_key=KEY)

    # the agent's input is the question part: the answer, and the expression that gives it away, stay behind
    assert seen["task_input"] == task.input and set(task.input) == {"question", "dataset", "protocol"}
    assert seen["api_key"].startswith(f"{auth.AGENT_PREFIX}:") and KEY not in seen["api_key"]
    assert seen["models"] == [MODEL, *EmbeddingsConfig().names]  # the policy first, then the embedding model
    outcomes = {what: refused(r) for what, r in seen["tries"].items()}
    assert outcomes.pop("a made-up key") == (401, "invalid_api_key")
    assert outcomes.pop("a path not there") == (404, "not_found")
    assert outcomes == dict.fromkeys(outcomes, (403, "permission_denied")), outcomes
    assert seen["own spans"].json()["accepted"] == 1 and seen["own OTLP spans"].status_code == 200
    # the worker, not the agent, ended the attempt: with the task's reward for the model's answer
    [ended] = store.get_rollouts([mine.rollout_id])
    answer = next(s for s in store.query_spans([mine.rollout_id]) if s.name == semconv.ROLLOUT).attributes["answer"]
    assert ended.status == "succeeded" and ended.reward == calc.reward(task.reward_input, answer)
    names = [s.name for s in store.query_spans([mine.rollout_id])]
    assert names.count(semconv.LLM_CALL) == 1 and {"agent.step", "chat tiny-calc"} <= set(names)
    assert store.query_spans([other.rollout_id]) == [] and store.get_rollouts([other.rollout_id])[0].status == "queued"
    store.cancel([other.rollout_id])


def test_only_the_lease_holder_ends_an_attempt(app):
    """Dequeue gives the lease token with the lease; heartbeats and the finish need it, even with the operator's
    key. The HTTP client keeps it, and gives its agents keys of their own."""
    store, http = app["store"], httpx.Client(base_url=app["store_url"], timeout=30,
                                             headers={"Authorization": f"Bearer {KEY}"})
    [rollout] = store.enqueue([Task(task_id="leased", input={})])
    leased = http.post("/v1/rollouts/dequeue", json={"worker_id": "w"}).json()
    while leased["rollout_id"] != rollout.rollout_id:
        leased = http.post("/v1/rollouts/dequeue", json={"worker_id": "w"}).json()
    path = f"/v1/rollouts/{leased['rollout_id']}/attempts/{leased['attempt_id']}"
    assert leased["lease_token"] == auth.lease_token(KEY, leased["rollout_id"], leased["attempt_id"])
    for headers in ({}, {"X-Lease-Token": "0" * 64}):
        assert refused(http.post(path + "/heartbeat", headers=headers)) == (403, "invalid_lease_token")
        assert refused(http.post(path + "/finish", json={"status": "succeeded", "reward": 1.0}, headers=headers)) == \
            (403, "invalid_lease_token")
    token = {"X-Lease-Token": leased["lease_token"]}
    assert http.post(path + "/heartbeat", headers=token).json()["status"] == "running"
    ended = http.post(path + "/finish", json={"status": "succeeded", "reward": 0.5}, headers=token).json()
    assert (ended["status"], ended["reward"]) == ("succeeded", 0.5)
    assert refused(httpx.get(app["store_url"] + "/v1/stats")) == (401, "invalid_api_key")  # no key at all

    # in batches: each lease with its token; a verdict without its token is refused alone, the others are taken
    batch = store.enqueue([Task(task_id=f"batch{i}", input={}) for i in range(3)])
    ours = {r.rollout_id for r in batch}
    answer = http.post("/v1/rollouts/dequeue_batch", json={"attempt_ids": [f"at-b{i}" for i in range(8)]}).json()
    leases = [lease for lease in answer if lease and lease["rollout_id"] in ours]
    assert len(leases) == 3 and all(x["lease_token"] == auth.lease_token(KEY, x["rollout_id"], x["attempt_id"])
                                    for x in leases)
    verdicts = [{"rollout_id": x["rollout_id"], "attempt_id": x["attempt_id"], "status": "succeeded", "reward": 1.0,
                 "lease_token": token} for x, token in zip(leases, [leases[0]["lease_token"], None, "0" * 64])]
    outcomes = http.post("/v1/rollouts/finish", json={"verdicts": verdicts}).json()
    assert outcomes[0]["rollout"]["status"] == "succeeded" and outcomes[0]["error"] is None
    assert [o["error"]["code"] for o in outcomes[1:]] == ["invalid_lease_token"] * 2
    assert [r.status for r in store.get_rollouts([x["rollout_id"] for x in leases])] == ["succeeded", "running",
                                                                                          "running"]
    store.cancel([x["rollout_id"] for x in answer if x])  # the one that ended stays as it is

    mine = store.enqueue([Task(task_id=f"remote{i}", input={"question": "What is 3+4?"}) for i in range(2)])
    keys = []

    def agent(task, base_url, model, api_key):
        keys.append(api_key)
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        return client.chat.completions.create(model=model, messages=[{"role": "user", "content": task["question"]}]
                                              ).choices[0].message.content

    client = LightningClient(app["store_url"], api_key=KEY)
    assert client.work(agent, lambda task, answer: 1.0, app["url"], MODEL, worker_id="remote") >= 2
    assert client.leases == {}  # each token dropped as its attempt ended
    for r in store.get_rollouts([r.rollout_id for r in mine]):
        assert (r.status, r.reward) == ("succeeded", 1.0)
        assert auth.agent_key(KEY, r.rollout_id, r.attempt_id) in keys
    assert KEY not in keys
