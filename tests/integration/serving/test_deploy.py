"""Deploying Serve apps: a replica the cluster has no room for (a GPU placement on a node without GPUs, more GPUs
than it has) waits for one with no end, since an autoscaler may yet add a node; the wait tells Serve's reason, with
the resources asked and those available, instead of a silent spinner."""

from __future__ import annotations

import time

import pytest
from ray import serve
from ray.serve.schema import ApplicationStatus

from lightning_ray.serving.deploy import _wait, delete_apps, start_apps


@serve.deployment(ray_actor_options={"num_cpus": 0, "resources": {"no_such_accelerator": 1}},
                  graceful_shutdown_timeout_s=0)
class Nowhere:
    def __call__(self) -> int:
        return 0


def test_a_replica_the_cluster_has_no_room_for_is_told_with_serves_reason(ray_cluster, serve_port, capsys):
    start_apps([serve.RunTarget(Nowhere.bind(), name="nowhere", route_prefix="/nowhere")], "127.0.0.1", serve_port)
    out, give_up = "", time.monotonic() + 30  # Serve tells after 30 s (3 s in the tests' cluster: conftest.py)
    try:
        while "still deploying nowhere:" not in out and time.monotonic() < give_up:
            with pytest.raises(TimeoutError):  # the wait itself has no end: a second at a time here
                _wait(["nowhere"], ApplicationStatus.RUNNING, time.monotonic() + 1)
            out += capsys.readouterr().out
    finally:
        delete_apps(["nowhere"])
    assert "still deploying nowhere:" in out and "no_such_accelerator" in out and "available" in out
