"""Sticky routing: every call of one rollout goes to the same replica, so a multi-turn agent's growing prompt finds
its prefix (KV cache) where the previous turn left it.

A Serve `RequestRouter` (run by each HTTP proxy and deployment handle). A request's key is Serve's own session id
(`x-session-id` header, `handle.options(session_id=...)`) or else its rollout id. The replicas are ranked by
rendezvous hashing of the key, so every proxy agrees without shared state and a replica joining or leaving moves
only the keys it gains or loses. Serve's routing loop then takes the first ranked replica that is alive and below
`max_ongoing_requests`, else the next: a dead or full replica's rollouts fall back deterministically, still
together. Requests without a key get Serve's default policy: the less loaded of two random replicas.

Where Serve's direct ingress is on (RAY_SERVE_ENABLE_DIRECT_INGRESS=1: a local cluster of a run turns it on), each
replica also answers HTTP on a port of its own, and a rollout worker sends its agents there (rollout/routes.py): the
same ranking (`rank`), made by the worker, with no proxy in the way (Serve's Python proxy costs more CPU per call
than the engine on a small model: benchmarks/README.md).
"""

from __future__ import annotations

import pickle
import random

import ray

from ray.serve.request_router import LocalityMixin, PendingRequest, RequestRouter, RunningReplica

from lightning_ray.config import loopback
from lightning_ray.rollout.routes import rank
from lightning_ray.serving.http import rollout_of

# Serve's direct ingress, as the environment of every Ray process: replicas serve HTTP on ports of their own; no
# 30 s drain when a replica stops (Serve's default, for an outside load balancer to notice: the workers ask anew);
# the replica's code on the loop that receives its HTTP, not on a second loop in a thread of its own (each call
# crossed between the two loops twice: ~20 ms a call at concurrency 32 on 2 cores, the endpoint 1.05-1.08x req/s,
# benchmarks/results/serve_user_code_loop.json). Once it serves, nothing in the replica blocks its loop: engines
# and weight loads run in threads or processes of their own.
DIRECT_INGRESS = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
                  "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


def routing_key(request: PendingRequest | None) -> str | None:
    if request is None:
        return None
    if request.metadata.session_id:
        return request.metadata.session_id
    if request.metadata.is_http_request and request.args and isinstance(request.args[0], bytes):
        # The proxy hands the router only the pickled request (ASGI scope, no body); the rollout id lives in its
        # path or X-Rollout-Id header, which Serve does not lift into the request metadata.
        try:
            return rollout_of(pickle.loads(request.args[0]).asgi_scope)
        except Exception:  # not the proxy's StreamingHTTPRequest: route it without stickiness
            return None
    return None


class RolloutAffinityRouter(LocalityMixin, RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        key = routing_key(pending_request)
        if key is None:
            ids = list(self.apply_locality_routing(pending_request))
            return [[self.curr_replicas[i] for i in random.sample(ids, min(2, len(ids)))]] if ids else []
        pending_request.routing_context.should_backoff = True  # back off once every rank was full, not spin
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[i]] for i in rank(key, list(by_id))]


async def replica_urls(app_name: str, host: str, node_ip: str) -> list[str]:
    """The base URLs (without /v1) of the app's replicas' own HTTP servers, from Serve's controller: none unless
    direct ingress is on. A replica binds serve.host: a loopback host reaches `node_ip`'s replicas only."""
    from ray.serve._private.common import RequestProtocol
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    groups = await controller.get_target_groups.remote(app_name)
    targets = [t for g in groups if g.protocol == RequestProtocol.HTTP and g.app_name == app_name  # not the proxies'
               for t in g.targets]
    if loopback(host):
        return [f"http://{host}:{t.port}" for t in targets if t.ip == node_ip]
    return [f"http://{host if host not in ('0.0.0.0', '::') else t.ip}:{t.port}" for t in targets]
