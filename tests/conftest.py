"""Shared fixtures: one real local Ray cluster and one tiny locally built model for the whole session."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import ray

from lightning_ray.config import ModelConfig
from lightning_ray.models import resolve_model_path

from helpers import free_port


@pytest.fixture(scope="session")
def ray_cluster():
    ray.init(num_cpus=4, namespace="lightning_ray_tests", include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_path():
    """The tiny test model (model.path=null): built (~25 s) once into the user cache, then reused."""
    return resolve_model_path(ModelConfig())


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
    from lightning_ray.weight_sync.registry import WeightRegistry

    @contextmanager
    def deploy(model_name: str = "tiny-calc", registry=None, **options):
        store = StoreClient.start(tmp_path_factory.mktemp("store"))
        own_registry = registry is None
        registry = registry or WeightRegistry.remote()
        url = deploy_policy(str(tiny_model_path), model_name, store, registry, port=serve_port, **options)
        try:
            yield {"url": url, "store": store, "registry": registry,
                   "new_rollout": lambda: store.enqueue([Task(task_id="test", input={})])[0].rollout_id}
        finally:
            serve.delete(APP_NAME)
            store.close()  # Serve keeps the handles a deleted app was deployed with: they would outlive the test
            if own_registry:
                ray.kill(registry)

    return deploy
