"""Shared fixtures: one real local Ray cluster and one tiny locally built model for the whole session."""

from __future__ import annotations

import os
import random
import socket
from contextlib import contextmanager

import pytest
import ray

from lightning_ray.config import ModelConfig
from lightning_ray.models import resolve_model_path


@pytest.fixture(scope="session")
def ray_cluster():
    ray.init(num_cpus=4, namespace="lightning_ray_tests", include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_path():
    """The tiny test model (model.path=null): built (~25 s) once into the user cache, then reused."""
    return resolve_model_path(ModelConfig())


# Ports handed to a job that binds them later. The kernel hands out port-0 binds and outgoing connections from its
# ephemeral range (/proc/sys/net/ipv4/ip_local_port_range: 32768-60999 by default), and Ray's workers bind ports in
# 10002-19999: a port picked from either could be taken by someone else before the job binds it. Below both, only
# a process that names the port itself can.
PORT_RANGE = range(20_000, 32_768)
_ports = random.Random(os.getpid()).sample(PORT_RANGE, len(PORT_RANGE))  # each pytest process its own order


def free_ports(n: int) -> list[int]:
    """n ports free on 127.0.0.1 now, outside the ranges the kernel and Ray take ports from (PORT_RANGE), and
    never the same one twice in a session (tests that start a job in a subprocess give it one: `from conftest
    import`)."""
    found = []
    while len(found) < n:
        port = _ports.pop()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        found.append(port)
    return found


def free_port() -> int:
    return free_ports(1)[0]


@pytest.fixture(scope="session")
def serve_port() -> int:
    """One free port for Serve's HTTP proxy, reused by every test that deploys (the proxy starts once)."""
    return free_port()


@pytest.fixture(scope="session")
def policy_app(ray_cluster, tiny_model_path, serve_port, tmp_path_factory):
    """Deploys the policy app on the tiny model with its own trace store and weight registry, for a `with` block:
    `with policy_app(defaults={...}) as app:` gives {"url", "store", "registry", "new_rollout"} and deletes the app
    afterwards. `app["new_rollout"]()` queues a rollout and returns its id (calls for unknown rollouts get a 404)."""
    from ray import serve

    from lightning_ray.serving.app import APP_NAME, deploy_policy
    from lightning_ray.store.client import StoreClient
    from lightning_ray.types import Task
    from lightning_ray.training.weights import WeightRegistry

    @contextmanager
    def deploy(model_name: str = "tiny-calc", registry=None, **options):
        store = StoreClient.start(tmp_path_factory.mktemp("store"))
        registry = registry or WeightRegistry.remote()
        url = deploy_policy(str(tiny_model_path), model_name, store, registry, port=serve_port, **options)
        try:
            yield {"url": url, "store": store, "registry": registry,
                   "new_rollout": lambda: store.enqueue([Task(task_id="test", input={})])[0].rollout_id}
        finally:
            serve.delete(APP_NAME)

    return deploy
