"""Weight sync under failure, through the real Serve app on the tiny model: a publish that does not fit is refused
whole and reported to the trainer's barrier; a load that fails part way takes the replica out of service; a replica
that starts during a publish is waited for, and one that starts after the publisher died waits for the next version;
a weight update ends generations that outlive the drain deadline; a client that stops reading a stream does not hold
a weight update back."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import ray
import torch
from helpers import publish

from lightning_ray.serving.app import APP_NAME
from lightning_ray.weight_sync.registry import WeightRegistry

MODEL = "tiny-calc"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "What is 3 + 4?"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def base_state(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).state_dict()


@pytest.fixture(scope="module")
def app(policy_app):
    with policy_app() as deployed:
        yield deployed


def version_of(state: dict, version: int) -> dict:
    """A distinct policy per version: the output layer scaled."""
    return {**state, "lm_head.weight": state["lm_head.weight"] * (1 - 0.05 * version)}


def latest(registry) -> int:
    return ray.get(registry.wait_newer.remote(-1, 0.0))[0]


def served(url: str) -> tuple[int, dict]:
    r = httpx.post(url + "/v1/chat/completions", json=BODY, timeout=30)
    return r.status_code, r.json()


def test_weights_that_do_not_fit_are_refused_whole(app, base_state):
    registry, v = app["registry"], latest(app["registry"])
    bad = version_of(base_state, v + 1)
    bad["model.norm.weight"] = bad["model.norm.weight"][:-1]
    start = time.time()
    with pytest.raises(ray.exceptions.RayTaskError, match=r"could not be loaded.*model\.norm\.weight has shape"):
        publish(registry, bad, v + 1)
    assert time.time() - start < 30  # told at once, not after the 60 s sync timeout (30 s: room for a loaded machine)
    health = httpx.get(app["url"] + "/health").json()
    assert health["policy_version"] == v and health["broken"] is None
    status, body = served(app["url"])
    assert status == 200 and body["system_fingerprint"] == f"lightning_ray-policy-v{v}"  # still whole, still serving
    publish(registry, version_of(base_state, v + 2), v + 2)  # the next good version goes through
    assert served(app["url"])[1]["system_fingerprint"] == f"lightning_ray-policy-v{v + 2}"


def test_a_load_that_fails_part_way_takes_the_replica_out_of_service(app, base_state):
    """load_state_dict copies every tensor it can: one that fails leaves the rest new and the version label old."""
    registry, v = app["registry"], latest(app["registry"])
    broken = version_of(base_state, v + 1)
    name = "model.layers.0.mlp.down_proj.weight"
    broken[name] = torch.empty(broken[name].shape, device="meta")  # passes the shape check, cannot be copied
    with pytest.raises(ray.exceptions.RayTaskError, match="failed part way"):
        publish(registry, broken, v + 1)
    assert httpx.get(app["url"] + "/health").json()["broken"]
    status, body = served(app["url"])
    assert status == 503 and body["error"]["code"] == "replica_unhealthy", body
    (replica,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith(f"SERVE_REPLICA::{APP_NAME}#")]
    with pytest.raises(ray.exceptions.RayTaskError, match="failed part way"):  # Serve's health check: replaced
        ray.get(ray.get_actor(replica, namespace="serve").check_health.remote())
    # The next complete version makes the weights whole again (on this replica, or on the one Serve put instead).
    publish(registry, version_of(base_state, v + 2), v + 2, timeout_s=120)
    deadline = time.time() + 60
    while (answer := served(app["url"]))[0] != 200:
        assert time.time() < deadline, answer
        time.sleep(1)
    assert answer[1]["system_fingerprint"] == f"lightning_ray-policy-v{v + 2}"


def test_a_client_that_stops_reading_does_not_hold_a_weight_update(app, base_state):
    """Serve's proxy reads the replica's stream whatever the client does, so the replica's generation ends and the
    update goes through long before the drain deadline (60 s here). Passes on the code before the deadline too:
    it guards the property the deadline does not cover."""
    v = latest(app["registry"])
    body = json.dumps({**BODY, "max_tokens": 480, "ignore_eos": True, "stream": True, "logprobs": True,
                       "top_logprobs": 20}).encode()
    port = int(app["url"].rsplit(":", 1)[1])
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # a small window: the server soon cannot send
        s.connect(("127.0.0.1", port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert s.recv(64).startswith(b"HTTP/1.1 200")  # the stream started; this client reads no more
        publish(app["registry"], version_of(base_state, v + 1), v + 1)
        # Read now, the stream is whole: an update that had waited for it would have ended it at the drain
        # deadline (a drain_timeout error in the stream), or, without one, not gone through (publish raises).
        s.settimeout(60)
        rest = b""
        while b"data: [DONE]" not in rest and (chunk := s.recv(1 << 16)):
            rest += chunk
    assert b"data: [DONE]" in rest and b"drain_timeout" not in rest, rest[-300:]


# The tests below deploy apps of their own (one app at a time: they replace the module's), so they come last.
def recording_registry(refs: list):
    """The real registry, logging the calls replicas make; the trainer publishes version 1 the moment the first
    replica registers (the worst moment for a replica that looked for the latest version before registering).
    Defined in a function so Ray ships the class by value (workers cannot import this test module)."""

    class RecordingRegistry(WeightRegistry.__ray_actor_class__):
        def __init__(self):
            super().__init__()
            self.calls, self.pending = [], refs

        async def register_replica(self, replica_id, handle=None):
            self.calls.append("register")
            await super().register_replica(replica_id, handle)
            if self.pending:
                await self.publish(1, self.pending)
                self.pending = None

        async def wait_newer(self, version, timeout_s):
            out = await super().wait_newer(version, timeout_s)
            self.calls.append(f"look {out[0]}")
            return out

        async def fail(self, replica_id, version, error):
            self.calls.append(f"fail {version}")
            await super().fail(replica_id, version, error)

        async def log(self) -> list[str]:
            return self.calls

    return ray.remote(num_cpus=0)(RecordingRegistry).remote()


def test_a_replica_that_starts_during_a_publish_starts_on_it(policy_app, base_state):
    registry = recording_registry([ray.put(version_of(base_state, 1))])
    with policy_app(registry) as deployed:
        calls = ray.get(registry.log.remote())
        # Registered before looking, so the version published in between is seen and loaded before serving.
        assert calls[:2] == ["register", "look 1"], calls
        assert httpx.get(deployed["url"] + "/health").json()["policy_version"] == 1
        assert served(deployed["url"])[1]["system_fingerprint"] == "lightning_ray-policy-v1"


def test_a_replica_started_after_the_publisher_died_waits_for_the_version_published_next(policy_app, base_state):
    """A version's payload is owned by the process that published it, learner rank 0. A replica that starts once
    that process is dead (the soak of 2026-12-04: the learner's node lost, then the policy's) cannot fetch it: it
    neither fails (Serve would start replica after replica) nor serves the weights it started with, but waits for
    the version the restarted rank publishes next (learner/driver.py), and serves that."""
    @ray.remote(num_cpus=0)
    class Publisher:  # a learner rank 0's part: the owner of what it puts in the object store
        def publish(self, state: dict) -> list:
            return [ray.put(state)]

    registry, publisher = recording_registry(None), Publisher.remote()
    ray.get(registry.publish.remote(1, ray.get(publisher.publish.remote(version_of(base_state, 1)))))
    ray.kill(publisher)

    def republish():  # once the replica has looked, as the restarted rank would, a while after its start
        deadline = time.monotonic() + 120
        while "look 1" not in ray.get(registry.log.remote()) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)
        ray.get(registry.publish.remote(2, [ray.put(version_of(base_state, 2))]))

    threading.Thread(target=republish, daemon=True).start()  # daemon: a failed deploy leaves no thread behind
    with policy_app(registry) as deployed:
        calls = ray.get(registry.log.remote())
        assert calls[:3] == ["register", "look 1", "look 2"] and "fail 1" not in calls, calls
        assert httpx.get(deployed["url"] + "/health").json()["policy_version"] == 2
        assert served(deployed["url"])[1]["system_fingerprint"] == "lightning_ray-policy-v2"


def test_a_weight_update_ends_generations_past_the_drain_deadline(policy_app, base_state):
    with policy_app(serve={"drain_timeout_s": 0.5}) as deployed:
        body = {**BODY, "max_tokens": 480, "ignore_eos": True, "n": 8, "stream": True}
        frames, first = [], threading.Event()

        def stream():
            with httpx.stream("POST", deployed["url"] + "/v1/chat/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    first.set()
                    frames.append(line)

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(30)
        start = time.time()
        publish(deployed["registry"], version_of(base_state, 1), 1)
        synced_s = time.time() - start
        reader.join(60)
    errors = [json.loads(f[6:])["error"] for f in frames if f.startswith("data: {") and '"error"' in f]
    assert errors and errors[0]["code"] == "drain_timeout", frames[-3:]
    # The drain_timeout frame shows the deadline ended the generation; the update then went through at once (30 s:
    # room for a loaded machine), not at its 60 s sync timeout.
    assert synced_s < 30, synced_s


def test_a_sleeping_engine_serves_nothing_until_the_next_version_wakes_it(policy_app, base_state):
    """engine.sleep_while_training (placement=colocated): the trainer's sleep request is acknowledged once serving is
    paused and the engine's memory freed (on CPUs nothing to free: the HF engine keeps its weights); a request in
    the meantime waits, and is answered by the version whose load woke the engine, never by the old one."""
    with policy_app(engine={"sleep_while_training": True}) as deployed:
        registry, url = deployed["registry"], deployed["url"]
        epoch = ray.get(registry.request_sleep.remote())
        ray.get(registry.wait_asleep.remote(epoch, 30.0))
        assert httpx.get(url + "/health").json()["paused"]
        answer = {}
        caller = threading.Thread(target=lambda: answer.update(served(url)[1]))
        caller.start()
        caller.join(2.0)  # an awake replica answers in ~50 ms
        assert caller.is_alive(), answer
        publish(registry, version_of(base_state, 1), 1)
        caller.join(30)
        assert answer["system_fingerprint"] == "lightning_ray-policy-v1"
        assert not httpx.get(url + "/health").json()["paused"]


def test_a_sleeping_engine_wakes_on_the_weights_it_holds_when_no_version_comes(policy_app):
    """An update whose every optimizer step was skipped publishes no version to wake the engines it put to sleep:
    the trainer's wake (trainer/update.py) opens serving again on the weights the replica holds."""
    with policy_app(engine={"sleep_while_training": True}) as deployed:
        registry, url = deployed["registry"], deployed["url"]
        epoch = ray.get(registry.request_sleep.remote())
        ray.get(registry.wait_asleep.remote(epoch, 30.0))
        answer = {}
        caller = threading.Thread(target=lambda: answer.update(served(url)[1]))
        caller.start()
        caller.join(2.0)
        assert caller.is_alive(), answer
        ray.get(registry.request_wake.remote())
        caller.join(30)
        assert answer["system_fingerprint"] == "lightning_ray-policy-v0"
        assert not httpx.get(url + "/health").json()["paused"]
        epoch = ray.get(registry.request_sleep.remote())  # and it sleeps again at the next update
        ray.get(registry.wait_asleep.remote(epoch, 30.0))
        assert httpx.get(url + "/health").json()["paused"]
