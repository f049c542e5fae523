"""Every layer of the store offers what lightning_ray/store/protocol.py declares (checked on the code, nothing
started): the two clients with the same parameters, the HTTP API a route per operation, the shard actor each one."""

from __future__ import annotations

import inspect

import pytest

from lightning_ray.client import LightningClient
from lightning_ray.store import http
from lightning_ray.store.client import StoreClient
from lightning_ray.store.protocol import RolloutStore
from lightning_ray.store.trace_store import TraceStore

OPERATIONS = [name for name, f in vars(RolloutStore).items() if inspect.isfunction(f) and not name.startswith("_")]


def mismatches(impl, spec) -> list[str]:
    """How a call written against `spec` could fail on `impl`: a parameter `spec` passes by position that `impl` has
    elsewhere, one passed by name that `impl` lacks, one optional in `spec` that `impl` requires, or one `impl`
    requires that `spec` never passes."""
    have, want = inspect.signature(impl).parameters, inspect.signature(spec).parameters
    positional = [p.name for p in have.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    by_name = any(p.kind is p.VAR_KEYWORD for p in have.values())
    out = []
    for i, p in enumerate(want.values()):
        if p.kind is p.POSITIONAL_OR_KEYWORD and (i >= len(positional) or positional[i] != p.name):
            out.append(f"{p.name} is not parameter {i}")
        elif p.name not in have and not by_name:
            out.append(f"no {p.name}")
        elif p.name in have and p.default is not p.empty and have[p.name].default is have[p.name].empty:
            out.append(f"{p.name} is required")
    out += [f"requires {p.name}" for p in have.values() if p.name not in want and p.default is p.empty
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return out


def test_the_check_catches_a_client_that_differs():
    class Swapped:  # attempt and rollout ids the other way round, and a parameter the protocol never passes
        def heartbeat(self, attempt_id: str, rollout_id: str, now: float) -> None: ...

    assert mismatches(Swapped.heartbeat, RolloutStore.heartbeat) == [
        "rollout_id is not parameter 1", "attempt_id is not parameter 2", "requires now"]


@pytest.mark.parametrize("layer", [StoreClient, LightningClient])
def test_each_client_offers_every_operation_with_its_parameters(layer):
    for op in OPERATIONS:
        assert hasattr(layer, op), f"{layer.__name__} has no {op}"
        assert mismatches(getattr(layer, op), getattr(RolloutStore, op)) == [], f"{layer.__name__}.{op}"


def test_the_http_api_has_a_route_per_operation_and_the_shard_actor_each_operation():
    routes = {route.endpoint.__name__ for route in http.api.routes if hasattr(route, "endpoint")}
    assert set(OPERATIONS) <= routes, set(OPERATIONS) - routes
    shard = TraceStore.__ray_metadata__.modified_class  # the class as written, under Ray's actor wrapper
    assert all(inspect.iscoroutinefunction(getattr(shard, op, None)) for op in OPERATIONS), \
        [op for op in OPERATIONS if not inspect.iscoroutinefunction(getattr(shard, op, None))]
