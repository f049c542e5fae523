"""Shared fixtures: one real local Ray cluster and one tiny locally built model for the whole session."""

from __future__ import annotations

import socket

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
    """The tiny model the main job uses by default: built (~25 s) once into the user cache, then reused."""
    return resolve_model_path(ModelConfig())


@pytest.fixture(scope="session")
def serve_port() -> int:
    """One free port for Serve's HTTP proxy, reused by every test that deploys (the proxy starts once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
