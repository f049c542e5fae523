"""Sticky routing: every call of one rollout goes to the same replica, so a multi-turn agent's growing prompt finds
its prefix (KV cache) where the previous turn left it.

A Serve `RequestRouter` (run by each HTTP proxy and deployment handle). A request's key is Serve's own session id
(`x-session-id` header, `handle.options(session_id=...)`) or else its rollout id. The replicas are ranked by
rendezvous hashing of the key, so every proxy agrees without shared state and a replica joining or leaving moves
only the keys it gains or loses. Serve's routing loop then takes the first ranked replica that is alive and below
`max_ongoing_requests`, else the next: a dead or full replica's rollouts fall back deterministically, still
together. Requests without a key get Serve's default policy: the less loaded of two random replicas.
"""

from __future__ import annotations

import hashlib
import pickle
import random

from ray.serve.request_router import LocalityMixin, PendingRequest, RequestRouter, RunningReplica

from lightning_ray.serving.http import rollout_of


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


def rank(key: str, replica_ids: list[str]) -> list[str]:
    """Replica ids, most preferred first, for this key (highest random weight; stable across processes)."""
    def weight(rid: str) -> bytes:
        return hashlib.blake2b(f"{key}\0{rid}".encode(), digest_size=8).digest()

    return sorted(replica_ids, key=weight, reverse=True)


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
