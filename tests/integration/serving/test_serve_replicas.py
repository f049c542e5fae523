"""Several replicas: every one follows the weights, a killed replica is replaced by Serve and the replacement
starts on the latest policy, the weight barrier never waits for a replica that is gone, and each rollout's calls
stick to one replica until it dies."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import ray
import torch

from lightning_ray.serving.app import APP_NAME
from lightning_ray.serving.http import REPLICA_HEADER
from lightning_ray.rollout.routes import ReplicaRoutes

MODEL = "tiny-calc"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "What is 3 + 4?"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def app(policy_app, tiny_model_path):
    with policy_app(serve={"num_replicas": 2}) as deployed:
        yield {**deployed, "model_path": tiny_model_path}


def publish(app, version: int) -> None:
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(app["model_path"], dtype=torch.float32).state_dict()
    state["lm_head.weight"] = state["lm_head.weight"] * (1 - 0.1 * version)
    ray.get(app["registry"].publish.remote(version, [ray.put(state)]))
    ray.get(app["registry"].wait_synced.remote(version, 120.0))


def served_versions(url: str, requests: int = 12) -> list[str]:
    out = []
    for _ in range(requests):
        r = httpx.post(url + "/v1/chat/completions", json=BODY, timeout=30)
        out.append(r.json()["system_fingerprint"] if r.status_code == 200 else f"HTTP {r.status_code}")
    return out


def replica_names() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{APP_NAME}#")]


def test_every_replica_serves_each_published_version(app):
    assert len(ray.get(app["registry"].served_versions.remote())) == 2
    publish(app, 1)
    assert set(ray.get(app["registry"].served_versions.remote()).values()) == {1}
    assert set(served_versions(app["url"])) == {"lightning_ray-policy-v1"}


def test_a_killed_replica_is_replaced_on_the_latest_policy(app):
    publish(app, 2)
    victim = replica_names()[0]
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    # Calls keep being answered by the live replica; one caught in flight may fail, but cleanly (no hang).
    during = served_versions(app["url"], 6)
    assert during.count("lightning_ray-policy-v2") >= 5, during
    # The new replica registers (at version 0) before it loads the latest version, then acknowledges v2 with no
    # new publish: wait for the dead one, the live one and the new one all on v2.
    deadline = time.time() + 120
    while len(versions := ray.get(app["registry"].served_versions.remote())) < 3 or set(versions.values()) != {2}:
        assert time.time() < deadline, f"Serve did not replace the replica on the latest policy: {versions}"
        time.sleep(0.5)
    publish(app, 3)  # the barrier completes: the dead replica is forgotten, the new one acknowledged
    versions = ray.get(app["registry"].served_versions.remote())
    assert len(versions) == 2 and set(versions.values()) == {3}
    assert set(served_versions(app["url"])) == {"lightning_ray-policy-v3"}


async def rollout_calls(url: str, rollout_ids: list[str], calls: int) -> dict[str, list[str]]:
    """`calls` concurrent calls per rollout (odd rollouts by path, even ones by X-Rollout-Id header) -> for each
    rollout, the replica that served each call (the response's x-lightning-ray-replica header), or the failure."""
    async def call(client, i, rollout_id):
        if i % 2:
            r = await client.post(f"{url}/rollouts/{rollout_id}/attempts/a/v1/chat/completions", json=BODY)
        else:
            r = await client.post(f"{url}/v1/chat/completions", json=BODY, headers={"X-Rollout-Id": rollout_id})
        return rollout_id, r.headers[REPLICA_HEADER] if r.status_code == 200 else f"HTTP {r.status_code}"

    async with httpx.AsyncClient(timeout=60) as client:
        done = await asyncio.gather(*[call(client, i, r) for i, r in enumerate(rollout_ids) for _ in range(calls)])
    return {r: [replica for rid, replica in done if rid == r] for r in rollout_ids}


def test_each_rollout_sticks_to_one_replica_until_it_dies(app):
    rollouts = [app["new_rollout"]() for _ in range(16)]
    served = asyncio.run(rollout_calls(app["url"], rollouts, 4))
    assert all(len(set(v)) == 1 and not v[0].startswith("HTTP") for v in served.values()), served
    assert len({v[0] for v in served.values()}) == 2, served  # rollouts spread (all on one replica: p = 2**-15)

    victim = served[rollouts[0]][0]
    ray.kill(ray.get_actor(next(n for n in replica_names() if n.endswith(victim)), namespace="serve"),
             no_restart=True)
    moved = [r for r in rollouts if served[r] == [victim] * 4]
    after = asyncio.run(rollout_calls(app["url"], moved, 3))
    # Every call is answered (a call routed to the dead replica is retried on a live one), none by the victim.
    assert all(not v.startswith("HTTP") and v != victim for calls in after.values() for v in calls), after


def answers(url: str) -> bool:
    try:
        return httpx.get(url + "/-/healthz", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def test_rollout_workers_send_each_rollout_to_one_replicas_own_server(app):
    """Serve's direct ingress (on in the tests' cluster, as in a run's): the URL a rollout worker gives a rollout's
    agent is one replica's own HTTP server, not the proxy, the same for every call of the rollout, and the
    rollouts spread over the replicas; the proxy's URL when the app has no replica to reach."""
    routes = ReplicaRoutes(app["url"], APP_NAME, app["registry"])
    here = ray.util.get_node_ip_address()
    deadline = time.time() + 120  # Serve's controller notices the previous test's killed replica, starts another
    while len(urls := ray.get(app["registry"].replica_urls.remote(APP_NAME, "127.0.0.1", here))) < 2 \
            or not all(map(answers, urls)):
        assert time.time() < deadline, urls
        time.sleep(0.5)
    rollouts = [app["new_rollout"]() for _ in range(16)]
    sent = {r: routes(r) for r in rollouts}
    assert set(sent.values()) <= set(urls) and app["url"] not in urls
    served = {r: asyncio.run(rollout_calls(url, [r], 3))[r] for r, url in sent.items()}
    assert all(len(set(v)) == 1 and not v[0].startswith("HTTP") for v in served.values()), served
    assert len({v[0] for v in served.values()}) == 2, served  # spread (all on one replica: p = 2**-15)
    assert ReplicaRoutes(app["url"], "no-such-app", app["registry"])(rollouts[0]) == app["url"]



@ray.remote
class Network:
    def __init__(self):
        self.up = False

    def set(self, up: bool) -> None:
        self.up = up

    def is_up(self) -> bool:
        return self.up


def test_a_replica_out_of_reach_for_a_while_is_waited_for_not_dropped(ray_cluster):
    """Dropped, the barrier went on without it, and the replica, once back, was never waited for again."""
    from lightning_ray.weight_sync.registry import WeightRegistry

    class OutOfReach:
        """A replica's handle as the registry sees it while Ray cannot reach the replica's node: every call raises
        ActorUnavailableError until the network is back. Not a real replica: a network partition between nodes cannot
        be made on one machine (calls to an actor that restarts raise it only now and then)."""

        def __init__(self, network):
            self.network = network
            self.__ray_ready__ = self

        def remote(self):
            return self._ready()

        async def _ready(self) -> bool:
            if not await self.network.is_up.remote():
                raise ray.exceptions.ActorUnavailableError("the node is unreachable", None)
            return True

    registry, network = WeightRegistry.remote(), Network.remote()
    ray.get(registry.register_replica.remote("near", None))
    ray.get(registry.register_replica.remote("far", OutOfReach(network)))
    ray.get([registry.ack.remote(name, 0) for name in ("near", "far")])
    ray.get(registry.publish.remote(1, []))
    ray.get(registry.ack.remote("near", 1))
    synced = registry.wait_synced.remote(1, 120.0)
    # the barrier asks the laggard whether it lives about every second: several times out of reach by now
    assert not ray.wait([synced], timeout=5)[0], "the barrier went on without the replica it could not reach"
    ray.get(network.set.remote(True))
    assert not ray.wait([synced], timeout=2)[0]  # back, but still on version 0
    ray.get(registry.ack.remote("far", 1))
    ray.get(synced, timeout=30)
