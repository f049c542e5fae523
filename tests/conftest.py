"""Shared fixtures: one real local Ray cluster and one tiny locally built model for the whole session."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager

import pytest
import ray

from lightning_ray.config import ModelConfig
from lightning_ray.models import resolve_model_path
from lightning_ray.serving.routing import DIRECT_INGRESS

from helpers import free_port, small


def pytest_collection_modifyitems(session, config, items):
    """On a fresh machine the tiny model's build is long: when a collected test needs it, it builds in a process
    of its own from the start, while the test files that do not need it run first (the unit tier's, then the
    integration tier's: testpaths' order, kept within each part; a test file that waited for the build left a core
    idle). Whoever resolves the model first builds it; the other waits on the cache's lock (models._cached)
    and finds it built."""
    global _tiny_build
    needs_model = {item.module for item in items if "tiny_model_path" in item.fixturenames}
    items.sort(key=lambda item: item.module in needs_model)  # stable: each file's tests stay together, in order
    if needs_model:  # a failed build is the fixture's to report
        _tiny_build = subprocess.Popen(
            [sys.executable, "-c", "from lightning_ray.config import ModelConfig; "
             "from lightning_ray.models import resolve_model_path; resolve_model_path(ModelConfig())"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def pytest_sessionfinish(session, exitstatus):
    if _tiny_build is not None and _tiny_build.poll() is None:  # the session ended first (-x); models._cached
        # builds into a temporary directory renamed whole, so a killed build leaves nothing half-written
        _tiny_build.kill()
        _tiny_build.wait()


_tiny_build: subprocess.Popen | None = None


@pytest.fixture(scope="session")
def ray_cluster():
    # as a run's local cluster has it (rollout workers call replicas directly): for this cluster's processes only,
    # not for the clusters tests start with `ray start` (test_cluster.py: several nodes, where it would need a host)
    # and Serve tells of a replica it cannot place after 3 s, not 30 (test_deploy.py)
    cluster_env = {**DIRECT_INGRESS, "RAY_SERVE_SLOW_STARTUP_WARNING_S": "3",
                   "RAY_SERVE_SLOW_STARTUP_WARNING_PERIOD_S": "3"}
    os.environ.update(cluster_env)
    ray.init(num_cpus=4, namespace="lightning_ray_tests", include_dashboard=False)
    for key in cluster_env:
        del os.environ[key]
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_path():
    """The tiny test model (model.path=null): built once into the user cache, then reused."""
    return resolve_model_path(ModelConfig())


@pytest.fixture(scope="session")
def serve_port() -> int:
    """One free port for Serve's HTTP proxy, reused by every test that deploys (the proxy starts once)."""
    return free_port()


@pytest.fixture(scope="session")
def policy_app(ray_cluster, tiny_model_path, serve_port, tmp_path_factory):
    """Deploys the policy app on the tiny model with its own trace store and weight registry, for a `with` block:
    `with policy_app(rollout={"max_tokens": 8}, serve={"api_key": KEY}) as app:` gives {"url", "store", "registry",
    "new_rollout"} and deletes the app afterwards. Its settings are a run's config (helpers.small: the tests' preset,
    the model named tiny-calc) with the sections given merged over it, as the job's would be. `app["new_rollout"]()`
    queues a rollout and returns its id (calls for unknown rollouts get a 404)."""
    from lightning_ray.serving.app import APP_NAME, deploy_policy
    from lightning_ray.serving.deploy import delete_apps
    from lightning_ray.store.client import StoreClient
    from lightning_ray.types import Task
    from lightning_ray.weight_sync.registry import WeightRegistry

    @contextmanager
    def deploy(registry=None, **sections):
        run_dir = tmp_path_factory.mktemp("policy-app")
        cfg = small({"run_dir": str(run_dir), "model": {"name": "tiny-calc"}, **sections,
                     "serve": {"port": serve_port, **sections.get("serve", {})}})
        store = StoreClient.start(run_dir)
        own_registry = registry is None
        registry = registry or WeightRegistry.remote()
        url = deploy_policy(cfg, str(tiny_model_path), store, registry)
        try:
            yield {"url": url, "store": store, "registry": registry,
                   "new_rollout": lambda: store.enqueue([Task(task_id="test", input={})])[0].rollout_id}
        finally:
            delete_apps([APP_NAME])
            store.close()  # Serve keeps the handles a deleted app was deployed with: they would outlive the test
            if own_registry:
                ray.kill(registry)

    return deploy
