"""Every layer of the store offers what lightning_ray/store/protocol.py declares (checked on the code, nothing
started): the two clients with the same parameters, the HTTP API a route per operation taking them, the shard actor
and its SQLite backend each operation by the same parameter names (keyed by attempt first, on encoded rows)."""

from __future__ import annotations

import inspect
import typing

import pytest
from pydantic import BaseModel

from lightning_ray.client import LightningClient
from lightning_ray.store import http
from lightning_ray.store.client import StoreClient
from lightning_ray.store.protocol import RolloutStore
from lightning_ray.store.rows import span_row
from lightning_ray.store.sqlite import SQLiteBackend
from lightning_ray.store.trace_store import TraceStore
from lightning_ray.types import Rollout, Span, Task

OPERATIONS = [name for name, f in vars(RolloutStore).items() if inspect.isfunction(f) and not name.startswith("_")]


def parameters(f) -> set[str]:
    return set(inspect.signature(f).parameters) - {"self"}


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


def route_parameters(route) -> set[str]:
    """What a route reads from a call: its path and query parameters and its JSON body's fields."""
    out = set()
    for name, kind in typing.get_type_hints(route.endpoint).items():
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            out |= set(kind.model_fields)
        elif name not in ("return", "request"):
            out.add(name)
    return out


def test_the_http_api_has_a_route_per_operation_taking_its_parameters():
    routes = {route.endpoint.__name__: route for route in http.api.routes if hasattr(route, "endpoint")}
    assert set(OPERATIONS) <= set(routes), set(OPERATIONS) - set(routes)
    for op in OPERATIONS:
        wanted = parameters(getattr(RolloutStore, op))
        # query_spans' rollout ids are a repeated query parameter: ?rollout_id=a&rollout_id=b
        taken = {"rollout_ids" if n == "rollout_id" and op == "query_spans" else n
                 for n in route_parameters(routes[op])}
        assert wanted <= taken, f"{op}: the route takes no {wanted - taken}"


# Beneath the clients the shard (TraceStore) and its SQLite backend speak the same operations keyed by attempt first
# and on the rows StoreClient encodes (store/protocol.py): these are the only parameters they may name otherwise.
ENCODED = {"enqueue": {"tasks", "config", "queue"}, "add_spans": {"spans"}}
ACTOR_ONLY = {"wait_for_rollouts", "stats", "add_spans"}  # the shard waits, counts errors and ingests (add_span_rows)


@pytest.mark.parametrize("layer", [TraceStore.__ray_metadata__.modified_class, SQLiteBackend],
                         ids=["TraceStore", "SQLiteBackend"])
def test_the_shard_and_its_backend_offer_each_operation_by_its_parameters(layer):
    for op in OPERATIONS:
        if layer is SQLiteBackend and op in ACTOR_ONLY:
            continue
        f = getattr(layer, op, None)
        assert f is not None, f"{layer.__name__} has no {op}"
        if layer is not SQLiteBackend:  # the actor's calls are awaited; the backend's run on its SQLite thread
            assert inspect.iscoroutinefunction(f), f"{layer.__name__}.{op} is not async"
        missing = parameters(getattr(RolloutStore, op)) - ENCODED.get(op, set()) - parameters(f)
        assert not missing, f"{layer.__name__}.{op}: no {missing}"


def test_a_span_row_without_a_finite_time_is_rejected_not_lost():
    """NaN is stored as NULL, whose NOT NULL violation INSERT OR IGNORE swallows: the span would vanish as a
    'duplicate'. It is rejected with its reason instead, as an infinite time and an int SQLite cannot hold."""
    db = SQLiteBackend()
    db.enqueue([Rollout(rollout_id="r1", task=Task(task_id="t", input={}))])
    good = span_row(Span(span_id="s0", trace_id="t", rollout_id="r1", name="ok", start_time=1.0, end_time=2.0))
    bad = [(*good[:6], start, end, *good[8:])
           for start, end in [(float("nan"), 2.0), (1.0, float("nan")), (float("inf"), None), (1.0, float("inf")),
                              (2**63, None)]]
    result = db.add_span_rows([good, *bad])
    assert (result["accepted"], result["duplicates"], result["rejected"]) == (1, 0, len(bad))
    assert all("start_time must be a finite number" in e for e in result["errors"])
    assert [s.name for s in db.query_spans(["r1"])] == ["ok"]
