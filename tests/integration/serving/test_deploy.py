"""Deploying Serve apps: a replica the cluster has no room for (a GPU placement on a node without GPUs, more GPUs
than it has) waits for one with no end, since an autoscaler may yet add a node; the wait tells Serve's reason, with
the resources asked and those available, instead of a silent spinner."""

from __future__ import annotations

import time

import pytest
from ray import serve
from ray.serve.schema import ApplicationStatus

from lightning_ray.serving.deploy import _wait, delete_apps, start_apps


@serve.deployment(ray_actor_options={"num_cpus": 0, "resources": {"no_such_accelerator": 1}})
class Nowhere:
    def __call__(self) -> int:
        return 0


def test_a_replica_the_cluster_has_no_room_for_is_told_with_serves_reason(ray_cluster, serve_port, capsys):
    start_apps([serve.RunTarget(Nowhere.bind(), name="nowhere", route_prefix="/nowhere")], "127.0.0.1", serve_port)
    try:
        with pytest.raises(TimeoutError):  # Serve tells after 30 s
            _wait(["nowhere"], ApplicationStatus.RUNNING, time.monotonic() + 40)
    finally:
        delete_apps(["nowhere"])
    out = capsys.readouterr().out
    assert "still deploying nowhere:" in out and "no_such_accelerator" in out and "available" in out
