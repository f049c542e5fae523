"""The Lightning client: an agent that lives elsewhere (another process or machine, no Ray installed) takes rollouts
from a lightning_ray store over HTTP, runs where it is, and streams its spans and rewards back.

    client = LightningClient("http://head:8000/store", api_key=...)   # the operator's key, serve.api_key
    client.work(agent, reward, policy_url="http://head:8000", model="policy")  # the run's model.name

The agent never sees that key: it gets one of its own for its attempt (lightning_ray/auth.py). The client offers
the same calls as the Ray StoreClient (store/protocol.py), so both drive the same rollout runner.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

from lightning_ray.rollout.runner import work
from lightning_ray.store import errors
from lightning_ray.types import Attempt, AttemptPolicy, Rollout, Span, Task, Verdict

_ERRORS = {cls.code: cls for cls in errors.StoreError.__subclasses__()}


class LightningClient:
    """A RolloutStore (store/protocol.py) over the store's HTTP API."""

    def __init__(self, store_url: str, api_key: str | None = None, timeout: float = 60.0):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=store_url.rstrip("/"), headers=headers, timeout=timeout)
        self.api_key = api_key
        self.leases: dict[str, str] = {}  # attempt id -> the lease token dequeue gave (with an API key set)

    def _call(self, method: str, path: str, **kwargs):
        r = self.http.request(method, path, **kwargs)
        if r.status_code >= 400:
            try:
                error = r.json()["error"]
            except (ValueError, KeyError):
                error = {"message": r.text, "code": None}
            raise _ERRORS.get(error.get("code"), errors.StoreError)(f"{r.status_code}: {error['message']}")
        return r.json()

    def enqueue(self, tasks: list[Task], config: AttemptPolicy | None = None, queue: str = "default") -> list[Rollout]:
        body = {"tasks": [t.model_dump() for t in tasks], "config": config and config.model_dump(), "queue": queue}
        return [Rollout(**r) for r in self._call("POST", "/v1/rollouts", json=body)]

    def dequeue(self, worker_id: str | None = None, attempt_id: str | None = None,
                queue: str = "default") -> Rollout | None:
        return self._leased(self._call("POST", "/v1/rollouts/dequeue",
                                       json={"worker_id": worker_id, "attempt_id": attempt_id, "queue": queue}))

    def dequeue_batch(self, attempt_ids: list[str], worker_id: str | None = None,
                      queue: str = "default") -> list[Rollout | None]:
        leases = self._call("POST", "/v1/rollouts/dequeue_batch",
                            json={"attempt_ids": attempt_ids, "worker_id": worker_id, "queue": queue})
        return [self._leased(r) for r in leases]

    def _leased(self, lease: dict | None) -> Rollout | None:
        """The rollout of a lease, its token kept for the attempt's heartbeats and verdict."""
        if lease is None:
            return None
        if token := lease.pop("lease_token", None):
            self.leases[lease["attempt_id"]] = token
        return Rollout(**lease)

    def _lease(self, attempt_id: str) -> dict:
        return {"x-lease-token": self.leases[attempt_id]} if attempt_id in self.leases else {}

    def heartbeat(self, rollout_id: str, attempt_id: str) -> Attempt:
        return Attempt(**self._call("POST", f"/v1/rollouts/{rollout_id}/attempts/{attempt_id}/heartbeat",
                                    headers=self._lease(attempt_id)))

    def finish_attempt(self, rollout_id: str, attempt_id: str, status: str, reward: float | None = None,
                       error: str | None = None) -> Rollout:
        try:
            return Rollout(**self._call("POST", f"/v1/rollouts/{rollout_id}/attempts/{attempt_id}/finish",
                                        json={"status": status, "reward": reward, "error": error},
                                        headers=self._lease(attempt_id)))
        finally:
            self.leases.pop(attempt_id, None)  # the attempt has ended, or cannot be ended by us: no call needs it

    def finish_attempts(self, verdicts: list[Verdict]) -> list[Rollout | errors.StoreError]:
        body = {"verdicts": [{**v.model_dump(), "lease_token": self.leases.get(v.attempt_id)} for v in verdicts]}
        try:
            outcomes = self._call("POST", "/v1/rollouts/finish", json=body)
        finally:
            for v in verdicts:  # ended, or not ours to end: no call needs them
                self.leases.pop(v.attempt_id, None)
        return [Rollout(**o["rollout"]) if o["rollout"] else
                _ERRORS.get(o["error"]["code"], errors.StoreError)(o["error"]["message"]) for o in outcomes]

    def add_spans(self, spans: list[Span]) -> dict:
        return self._call("POST", "/v1/spans", content=_spans_json(spans),
                          headers={"content-type": "application/json"})

    def wait_for_rollouts(self, rollout_ids: list[str], timeout: float | None = None) -> list[Rollout]:
        """The rollouts that ended within `timeout` seconds (None: all of them, however long): long polls of at
        most 30 s each, as the server caps one wait."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 30.0 if deadline is None else min(30.0, max(deadline - time.monotonic(), 0.0))
            ended = [Rollout(**r) for r in self._call("POST", "/v1/rollouts/wait",
                                                      json={"rollout_ids": rollout_ids, "timeout": left})]
            if len(ended) == len(set(rollout_ids)) or (deadline is not None and time.monotonic() >= deadline):
                return ended

    def query_spans(self, rollout_ids: list[str] | None = None, **filters) -> list[Span]:
        params = {"rollout_id": rollout_ids or [], **{k: v for k, v in filters.items() if v is not None}}
        return [Span(**s) for s in self._call("GET", "/v1/spans", params=params)]

    def stats(self) -> dict:
        return self._call("GET", "/v1/stats")

    def work(self, agent: Callable, reward: Callable, policy_url: str, model: str, worker_id: str | None = None,
             tracing_backend: str = "embedded", queue: str = "default", max_abandoned: int | None = None) -> int:
        """Run rollouts until `queue` is empty, or until `max_abandoned` agent threads left behind at timeouts still
        run in this process (see rollout.runner: restart the process then, as Ray restarts its workers, since
        nothing else stops them); return how many ran. Each agent gets a key for its own attempt, not this
        client's."""
        return work(self, agent, reward, policy_url, model, self.api_key, worker_id, tracing_backend, max_abandoned,
                    queue)


def _spans_json(spans: list[Span]) -> bytes:
    return b'{"spans":[' + b",".join(s.model_dump_json().encode() for s in spans) + b"]}"
