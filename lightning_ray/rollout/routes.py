"""Where a rollout's agent sends its calls: straight to one replica's own HTTP server where Serve's direct ingress is
on (serving/routing.py), the replica the rollout's id ranks first, as Serve's proxies rank them for its calls; else
to the proxy. Nothing here imports Ray Serve: an agent's own runtime environment may not be able to (AutoGen's
protobuf 5 against Serve's gRPC code), so the weight registry asks Serve's controller for the replicas.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import urllib.parse

import ray

logger = logging.getLogger(__name__)


def rank(key: str, replica_ids: list[str]) -> list[str]:
    """Replica ids, most preferred first, for this key (highest random weight; stable across processes)."""
    def weight(rid: str) -> bytes:
        return hashlib.blake2b(f"{key}\0{rid}".encode(), digest_size=8).digest()

    return sorted(replica_ids, key=weight, reverse=True)


class ReplicaRoutes:
    """A rollout's base URL (without /v1): the replica's own server that `rank` puts first for the rollout, else
    (no direct ingress, or no replica reachable from this node) the proxy's. The replicas are asked of the run's
    weight registry (`registry`: its handle or its name) at most every `refresh_s`: a replica gone meanwhile fails
    its calls as the platform's failure (the attempt is retried, not scored), and a later list leaves it out."""

    def __init__(self, proxy_url: str, app_name: str, registry, refresh_s: float = 2.0):
        self.proxy_url, self.app_name, self.registry, self.refresh_s = proxy_url, app_name, registry, refresh_s
        self.host = urllib.parse.urlsplit(proxy_url).hostname
        self._urls: list[str] = []
        self._asked = -float("inf")
        self._lock = threading.Lock()

    def __call__(self, rollout_id: str) -> str:
        with self._lock:
            if time.monotonic() - self._asked > self.refresh_s:
                try:
                    registry = ray.get_actor(self.registry) if isinstance(self.registry, str) else self.registry
                    self._urls = ray.get(registry.replica_urls.remote(self.app_name, self.host,
                                                                      ray.util.get_node_ip_address()), timeout=30)
                except Exception:  # the registry or Serve's controller busy or restarting: the proxy routes meanwhile
                    logger.warning("could not list the policy's replicas; calls go through Serve's proxy",
                                   exc_info=True)
                    self._urls = []
                self._asked = time.monotonic()
            urls = self._urls
        return rank(rollout_id, urls)[0] if urls else self.proxy_url
