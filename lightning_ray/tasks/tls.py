"""One TLS context per process for the built-in agents' HTTP clients. An httpx client built without one loads the
CA certificates itself (~50 ms of CPU each, measured on a 2-core machine, for plain-http calls all the same), and
agents whose client is bound to a rollout's own event loop or closed with it cannot share one client across
rollouts: they share this instead (the calc agent shares its whole client, docs/03-agents-and-tasks.md)."""

from __future__ import annotations

import ssl
from functools import cache

import httpx


@cache
def tls_context() -> ssl.SSLContext:
    return httpx.create_ssl_context()
