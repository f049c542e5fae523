"""RolloutWorker: a Ray actor that runs the user's agent, unmodified, on rollouts from the store's queue."""

from __future__ import annotations

import threading

import ray

from lightning_ray.config import TaskConfig
from lightning_ray.rollout.agents import kill_running, resolve_agent
from lightning_ray.rollout.batching import BatchedStore
from lightning_ray.rollout.runner import abandoned_agents, work
from lightning_ray.rollout.routes import ReplicaRoutes
from lightning_ray.tasks import load_task


@ray.remote(num_cpus=0, concurrency_groups={"control": 1})  # stop_agents runs while every slot is busy
class RolloutWorker:
    """Constructed from plain values only: Ray restarts a dead worker with its constructor's arguments, and those
    holding actor handles (the store's) would live in the object store, where they may be gone by then."""

    def __init__(self, task: TaskConfig, server_url: str, model_name: str, api_key: str | None = None,
                 tracing_backend: str = "embedded", timeout_seconds: float | None = None,
                 max_abandoned: int | None = None, queue: str = "default", direct: tuple[str, str] | None = None):
        """`direct`: the policy app's name and the run's weight registry's, to send agents straight to the app's
        replicas where Serve's direct ingress is on (rollout/routes.py); None: to `server_url`."""
        self.agent, self.reward = resolve_agent(task, timeout_seconds), load_task(task.name).reward
        self.max_abandoned, self.queue = max_abandoned, queue  # the run's own queue: its rollouts only
        self.server_url = ReplicaRoutes(server_url, *direct) if direct else server_url
        self.model_name = model_name
        self.api_key, self.tracing_backend = api_key, tracing_backend  # the operator's: its agents get their own
        self.worker_id = ray.get_runtime_context().get_actor_id()
        self.store: BatchedStore | None = None  # the run's store, its slots' dequeues and verdicts batched
        self._store_lock = threading.Lock()

    def work(self, store) -> int:
        """Run rollouts from the run's queue until it is empty, or this process holds `max_abandoned` agent threads
        left behind at timeouts (then `worn_out`); return how many ran. The worker's slots run this at once, and
        share one store whose calls they make together go as one (rollout/batching.py)."""
        with self._store_lock:
            self.store = self.store or BatchedStore(store)
        return work(self.store, self.agent, self.reward, self.server_url, self.model_name, self.api_key,
                    self.worker_id, self.tracing_backend, self.max_abandoned, self.queue)

    @ray.method(concurrency_group="control")
    def stop_agents(self) -> int:
        """Kill the agent commands running here, and what they started (the run stops: ray.kill would leave them)."""
        return kill_running()

    def worn_out(self) -> bool:
        """Due a restart (rollout/dispatch.py does it once none of its rollouts runs): its abandoned agent threads
        cannot be stopped any other way."""
        return self.max_abandoned is not None and abandoned_agents() >= self.max_abandoned
