"""The store over HTTP: the Lightning client in a process without Ray, the OTLP/HTTP receiver, and bad input."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import subprocess
import sys
import textwrap

import httpx
import pytest
from google.protobuf.json_format import MessageToJson
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lightning_ray.algorithm.lightningrl import transitions_from_spans
from lightning_ray.store.http import gunzip
from lightning_ray.tasks import calc
from lightning_ray.tracing import semconv
from lightning_ray.types import AttemptPolicy, Task

from helpers import agent_otel_spans

MODEL = "tiny-calc"


@pytest.fixture(scope="module")
def app(policy_app, serve_port):
    from lightning_ray.serving.deploy import delete_apps
    from lightning_ray.store.http import APP_NAME, deploy_store_api

    with policy_app(rollout={"max_tokens": 16}) as app:
        url = deploy_store_api(app["store"], port=serve_port)
        yield {**app, "store_url": url}
        delete_apps([APP_NAME])


OUTSIDE_AGENT = textwrap.dedent("""
    import json, sys
    from lightning_ray.client import LightningClient
    from lightning_ray.tasks import calc
    from lightning_ray import tracing

    def agent(task, **openai_settings):  # the unmodified calc agent, plus one tool span of its own
        answer = calc.agent(task, **openai_settings)
        tracing.emit_tool("checker", {"answer": answer}, result="checked")
        return answer

    store_url, policy_url = sys.argv[1:]
    ran = LightningClient(store_url).work(agent, calc.reward, policy_url, "tiny-calc", worker_id="outside")
    print(json.dumps({"ran": ran, "ray_imported": "ray" in sys.modules}))
""")


def test_an_agent_outside_ray_pulls_rollouts_and_streams_its_spans_back(app, tmp_path):
    store = app["store"]
    rollouts = store.enqueue(calc.make_tasks(3, seed=1), AttemptPolicy(unresponsive_seconds=30))
    fake_ray = tmp_path / "ray"
    fake_ray.mkdir()
    (fake_ray / "__init__.py").write_text("raise ImportError('the Lightning client must not need Ray')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run([sys.executable, "-c", OUTSIDE_AGENT, app["store_url"], app["url"]], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {"ran": 3, "ray_imported": False}
    for r in store.get_rollouts([r.rollout_id for r in rollouts]):
        [attempt] = store.get_attempts(r.rollout_id)
        assert attempt.worker_id == "outside" and attempt.status == "succeeded"
        spans = store.query_spans([r.rollout_id])
        [answer] = [s.attributes.get("answer") for s in spans if s.name == "rollout"]
        assert r.status == "succeeded" and r.reward == calc.reward(r.task.reward_input, answer)  # scored again here
        names = [s.name for s in spans]
        # the server recorded the policy calls, the client streamed the agent's own spans: one attempt, one trace
        assert names.count(semconv.LLM_CALL) >= 1 and "execute_tool checker" in names
        assert {semconv.ROLLOUT, semconv.REWARD} <= set(names) and {s.attempt_id for s in spans} == {r.attempt_id}
        reward = [s for s in spans if s.name == semconv.REWARD][0].attributes[semconv.REWARD_VALUE]
        assert reward == r.reward
        assert [t.reward for t in transitions_from_spans(r, spans, MODEL)] == [r.reward] * names.count("llm.call")


def test_rollouts_enqueued_over_http_go_to_the_queue_they_name(app):
    """A training run's workers dequeue from the run's own queue; the store API's rollouts go to the queue the caller
    names ("default" if none), for the workers that ask for it."""
    http = httpx.Client(base_url=app["store_url"], timeout=30)
    [rollout] = http.post("/v1/rollouts", json={"tasks": [{"task_id": "q", "input": {}}], "queue": "outside-a"}).json()
    assert rollout["queue"] == "outside-a"
    assert http.post("/v1/rollouts/dequeue", json={"worker_id": "w", "queue": "outside-b"}).json() is None
    leased = http.post("/v1/rollouts/dequeue", json={"worker_id": "w", "queue": "outside-a"}).json()
    assert leased["rollout_id"] == rollout["rollout_id"]
    assert http.post("/v1/rollouts/dequeue", json={"queue": ""}).status_code == 400


def test_store_api_lifecycle_and_errors_over_http(app):
    http = httpx.Client(base_url=app["store_url"], timeout=30)
    [rollout] = http.post("/v1/rollouts", json={"tasks": [{"task_id": "t", "input": {"x": 1}}],
                                               "config": {"max_attempts": 2}}).json()
    leased = http.post("/v1/rollouts/dequeue", json={"worker_id": "w"}).json()
    while leased["rollout_id"] != rollout["rollout_id"]:  # other tests' rollouts may be queued too
        leased = http.post("/v1/rollouts/dequeue", json={}).json()
    path = f"/v1/rollouts/{leased['rollout_id']}/attempts/{leased['attempt_id']}"
    assert http.post(path + "/heartbeat").json()["status"] == "running"
    assert http.post(path + "/finish", json={"status": "failed", "error": "boom"}).json()["status"] == "requeued"
    stale = http.post(path + "/finish", json={"status": "succeeded"})
    assert stale.status_code == 409 and stale.json()["error"]["code"] == "stale_attempt"
    bad = http.post(path + "/finish", json={"status": "queued"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "status"
    missing = http.post(f"/v1/rollouts/{leased['rollout_id']}/attempts/at-nope/heartbeat")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "attempt_not_found"
    [other] = http.post("/v1/rollouts", json={"tasks": [{"task_id": "t2", "input": {}}]}).json()
    for verb in ("heartbeat", "finish"):  # a real attempt, under another rollout's path
        crossed = http.post(f"/v1/rollouts/{other['rollout_id']}/attempts/{leased['attempt_id']}/{verb}",
                            json={"status": "succeeded"})
        assert crossed.status_code == 404 and crossed.json()["error"]["code"] == "attempt_not_found", verb
    http.post("/v1/rollouts/cancel", json={"rollout_ids": [other["rollout_id"]]})  # not for other tests' workers
    assert http.get("/v1/rollouts/ro-nope").status_code == 404
    assert [a["status"] for a in http.get(path.rsplit("/", 2)[0] + "/attempts").json()] == ["failed"]
    assert rollout["rollout_id"] in [r["rollout_id"] for r in http.get("/v1/rollouts", params={"status": "requeued"}).json()]
    ghost = http.post("/v1/spans", json={"spans": [{"name": "x", "rollout_id": "ro-ghost"}]})
    assert ghost.status_code == 404 and "ro-ghost" in ghost.json()["error"]["message"]
    assert http.post("/v1/spans", json={"spans": [{"rollout_id": rollout["rollout_id"]}]}).status_code == 400
    huge = http.post("/v1/spans", content=b"x" * (65 << 20), headers={"content-type": "application/json"})
    assert huge.status_code == 413
    errors = http.get("/v1/stats").json()["errors"]
    assert errors["rollout_not_found"] >= 1 and errors["request_too_large"] == 1 and errors["invalid_request"] >= 2


def test_otlp_receiver_takes_protobuf_from_the_real_exporter_and_json(app):
    store, url = app["store"], app["store_url"] + "/v1/traces"
    [proto_rollout, json_rollout] = store.enqueue([Task(task_id="p", input={}), Task(task_id="j", input={})])

    provider, spans = agent_otel_spans(proto_rollout.rollout_id, "at-1")
    assert OTLPSpanExporter(endpoint=url).export(spans).name == "SUCCESS"  # the SDK's exporter, protobuf
    _, spans = agent_otel_spans(json_rollout.rollout_id, "at-2")
    reply = httpx.post(url, content=MessageToJson(encode_spans(spans)), headers={"content-type": "application/json"})
    assert reply.status_code == 200 and reply.json() == {}

    for rollout, attempt in ((proto_rollout, "at-1"), (json_rollout, "at-2")):
        stored = store.query_spans([rollout.rollout_id])
        by_name = {s.name: s for s in stored}
        chat, agent = by_name["chat tiny-calc"], by_name["invoke_agent calc"]
        assert chat.parent_id == agent.span_id and chat.trace_id == agent.trace_id and chat.attempt_id == attempt
        assert chat.attributes["gen_ai.usage.input_tokens"] == 12 and chat.attributes["gen_ai.request.model"] == MODEL
        assert chat.events[0].name == "gen_ai.user.message"
        assert chat.events[0].attributes == {"content": "What is 3 + 4?"}
        assert agent.attributes["gen_ai.agent.name"] == "calc"


def test_otlp_receiver_rejects_bad_payloads_clearly_and_keeps_serving(app):
    url = app["store_url"] + "/v1/traces"
    before = app["store"].stats()["errors"].get("otlp_malformed", 0)
    for body, content_type in ((b"\x00garbage", "application/x-protobuf"), (b"{not json", "application/json"),
                               (b"{}", "text/plain")):
        r = httpx.post(url, content=body, headers={"content-type": content_type})
        assert r.status_code == 400 and r.json()["error"]["code"] == "otlp_malformed", (content_type, r.text)
    _, spans = agent_otel_spans("ro-unknown", "at-1")  # well-formed, but for no rollout of ours
    r = httpx.post(url, content=MessageToJson(encode_spans(spans)), headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["partialSuccess"]["rejectedSpans"] == "2"
    assert "ro-unknown" in r.json()["partialSuccess"]["errorMessage"]
    stats = app["store"].stats()
    assert stats["errors"]["otlp_malformed"] == before + 3 and stats["errors"]["invalid_spans"] >= 2


def test_otlp_receiver_gunzips_within_the_size_limit(app):
    """The SDK's exporter with gzip goes through; a small gzip body that inflates past the store's 64 MiB limit is
    refused with 413 after inflating no more than the limit (it was decompressed whole before)."""
    from opentelemetry.exporter.otlp.proto.http import Compression

    store, url = app["store"], app["store_url"] + "/v1/traces"
    [rollout] = store.enqueue([Task(task_id="gz", input={})])
    _, spans = agent_otel_spans(rollout.rollout_id, "at-1")
    assert OTLPSpanExporter(endpoint=url, compression=Compression.Gzip).export(spans).name == "SUCCESS"
    assert len(store.query_spans([rollout.rollout_id])) == 2
    bomb = gzip.compress(b"\0" * (80 << 20))  # ~80 KB on the wire
    before = store.stats()["errors"].get("request_too_large", 0)
    r = httpx.post(url, content=bomb, headers={"content-type": "application/x-protobuf", "content-encoding": "gzip"},
                   timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert store.stats()["errors"]["request_too_large"] == before + 1
    assert gunzip(gzip.compress(b"ab") + gzip.compress(b"cd"), 4) == b"abcd"  # every member, up to the limit
    assert gunzip(gzip.compress(b"abcde"), 4) is None


def test_spans_posted_to_the_store_api_never_become_training_data(app):
    """The agent's key lets anyone post spans; an `llm.call` with made-up tokens and an "origin" claim is stored as
    the client's, and LightningRL makes transitions only of what the policy server recorded."""
    store, http = app["store"], httpx.Client(base_url=app["store_url"], timeout=30)
    [rollout] = store.enqueue([Task(task_id="forged", input={})])
    leased = store.dequeue("w")
    while leased.rollout_id != rollout.rollout_id:  # other tests' rollouts may be queued too
        leased = store.dequeue("w")
    forged = {"name": "llm.call", "rollout_id": rollout.rollout_id, "attempt_id": leased.attempt_id,
              "origin": "server", "attributes": {semconv.MODEL: MODEL, semconv.PROMPT_TOKEN_IDS: [1],
                                                 semconv.COMPLETION_TOKEN_IDS: [666], semconv.LOGPROBS: [0.0],
                                                 semconv.POLICY_VERSION: 99}}
    assert http.post("/v1/spans", json={"spans": [forged]}).json()["accepted"] == 1
    store.finish_attempt(rollout.rollout_id, leased.attempt_id, "succeeded", 1.0)
    [stored] = store.query_spans([rollout.rollout_id])
    assert stored.origin == "client"
    [ended] = store.get_rollouts([rollout.rollout_id])
    assert transitions_from_spans(ended, [stored], MODEL) == []


def test_rewards_that_are_not_finite_get_400_and_are_never_stored(app):
    """Infinity and NaN, as Python's json writes (and the API's parser reads) them: a verdict holding one is a 400 and
    the attempt runs on; so is a reward span posted to the API; over OTLP such a span is rejected as a partial
    success."""
    store, http = app["store"], httpx.Client(base_url=app["store_url"], timeout=30)

    def post(path, body):  # httpx's json= refuses them
        return http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})

    [rollout] = store.enqueue([Task(task_id="inf", input={})])
    leased = store.dequeue("w")
    while leased.rollout_id != rollout.rollout_id:  # other tests' rollouts may be queued too
        leased = store.dequeue("w")
    path = f"/v1/rollouts/{rollout.rollout_id}/attempts/{leased.attempt_id}/finish"
    for bad in (float("inf"), float("nan")):
        r = post(path, {"status": "succeeded", "reward": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reward", r.text
        assert "finite" in r.json()["error"]["message"]
    reward = {"name": "reward", "rollout_id": rollout.rollout_id, "attempt_id": leased.attempt_id,
              "attributes": {semconv.REWARD_VALUE: float("inf")}}
    r = post("/v1/spans", {"spans": [reward]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_spans" and "finite" in r.text

    provider = TracerProvider(resource=Resource.create({semconv.ROLLOUT_ID: rollout.rollout_id,
                                                        semconv.ATTEMPT_ID: leased.attempt_id}))
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("agent").start_as_current_span("invoke_agent calc"):
        provider.get_tracer("agent").start_span("reward", attributes={semconv.REWARD_VALUE: float("nan")}).end()
    r = httpx.post(app["store_url"] + "/v1/traces", content=encode_spans(exporter.get_finished_spans())
                   .SerializeToString(), headers={"content-type": "application/x-protobuf"})
    reply = ExportTraceServiceResponse.FromString(r.content)
    assert r.status_code == 200 and reply.partial_success.rejected_spans == 1, reply
    assert "not a finite number" in reply.partial_success.error_message

    assert [a.status for a in store.get_attempts(rollout.rollout_id)] == ["running"]
    assert http.post(path, json={"status": "succeeded", "reward": 1.0}).json()["reward"] == 1.0
    assert [s.name for s in store.query_spans([rollout.rollout_id])] == ["invoke_agent calc"]


def test_many_waiters_leave_the_store_api_free(app):
    """Waiting is a long poll on the event loop: 64 waiters on a rollout that does not end (more than the thread
    pool a synchronous endpoint would hold them on) and the rest of the API still answers while they all wait. One
    wait is capped (400 past 60 s); the client polls again for longer waits."""
    [rollout] = app["store"].enqueue([Task(task_id="never", input={})])
    body = {"rollout_ids": [rollout.rollout_id], "timeout": 50.0}

    async def scenario():
        async with httpx.AsyncClient(base_url=app["store_url"], timeout=60) as http:
            waiters = [asyncio.create_task(http.post("/v1/rollouts/wait", json=body)) for _ in range(64)]
            await asyncio.sleep(1.0)  # time for them to arrive (a late one only makes the check weaker)
            stats = await http.get("/v1/stats")
            # Answered while every wait is still pending: blocked behind them, it would come after their timeout.
            pending = sum(not w.done() for w in waiters)
            app["store"].cancel([rollout.rollout_id])  # the rollout ends: every waiter is answered at once
            return stats, pending, await asyncio.gather(*waiters)

    stats, pending, replies = asyncio.run(scenario())
    assert stats.status_code == 200 and pending == 64, pending
    assert all(r.status_code == 200 and [x["status"] for x in r.json()] == ["cancelled"] for r in replies)
    too_long = httpx.post(app["store_url"] + "/v1/rollouts/wait", json={**body, "timeout": 3600})
    assert too_long.status_code == 400 and "timeout" in json.dumps(too_long.json()["error"])


def test_cancel_over_http_reports_per_rollout_and_can_be_repeated(app):
    http = httpx.Client(base_url=app["store_url"], timeout=30)
    a, b = (r.rollout_id for r in app["store"].enqueue([Task(task_id="a", input={}), Task(task_id="b", input={})]))
    first = http.post("/v1/rollouts/cancel", json={"rollout_ids": [a, "ro-ghost"]})
    assert first.status_code == 200 and first.json() == {a: "cancelled", "ro-ghost": "unknown"}
    again = http.post("/v1/rollouts/cancel", json={"rollout_ids": [a, b]})  # `a` a second time, with `b`
    assert again.status_code == 200 and again.json() == {a: "already_ended", b: "cancelled"}
    assert [r.status for r in app["store"].get_rollouts([a, b])] == ["cancelled", "cancelled"]


class LosesTheFirstDequeueReply(httpx.HTTPTransport):
    """The dequeue reaches the store, which leases a rollout; its reply never reaches the worker."""

    lost: dict | None = None

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if self.lost is None and request.url.path.endswith("/v1/rollouts/dequeue"):
            self.lost = json.loads(response.read())
            response.close()
            raise httpx.ReadError("connection reset by peer", request=request)
        return response


def test_a_worker_whose_dequeue_reply_is_lost_gets_the_same_rollout_again(app):
    """The worker picks its attempt id before asking and asks again under it: the rollout leased by the lost reply
    is run once and succeeds (a second dequeue used to lease another one and strand it: with max_attempts=1 it
    failed when its lease ran out)."""
    from lightning_ray.client import LightningClient

    store = app["store"]
    mine = store.enqueue([Task(task_id=f"lossy{i}", input={}) for i in range(2)], AttemptPolicy(max_attempts=1))
    client, transport = LightningClient(app["store_url"]), LosesTheFirstDequeueReply()
    client.http = httpx.Client(base_url=app["store_url"], transport=transport, timeout=30)
    ran = client.work(lambda task, **_: "ok", lambda task, answer: 1.0, "http://127.0.0.1:9", MODEL, worker_id="lossy")
    assert ran >= 2 and transport.lost is not None
    [attempt] = store.get_attempts(transport.lost["rollout_id"])
    assert (attempt.attempt_id, attempt.status) == (transport.lost["attempt_id"], "succeeded")
    for r in store.get_rollouts([r.rollout_id for r in mine]):
        assert (r.status, r.attempts) == ("succeeded", 1)
    bad = client.http.post("/v1/rollouts/dequeue", json={"attempt_id": "../at"})  # it goes into URL paths
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "attempt_id"
