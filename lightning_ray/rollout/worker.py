"""RolloutWorker: runs the user's agent, unmodified, on rollouts taken from the store's queue."""

from __future__ import annotations

import time

import ray

from lightning_ray.tasks import load_task
from lightning_ray.tracing import semconv
from lightning_ray.types import Rollout, Span


@ray.remote(num_cpus=0)
class RolloutWorker:
    def __init__(self, task_name: str, store, server_url: str, model_name: str, api_key: str | None = None):
        self.task = load_task(task_name)
        self.store, self.server_url, self.model_name = store, server_url, model_name
        self.api_key = api_key or "EMPTY"

    def work(self) -> int:
        """Run rollouts until the queue is empty; return how many ran."""
        done = 0
        while (rollout := ray.get(self.store.dequeue.remote())) is not None:
            self.run(rollout)
            done += 1
        return done

    def run(self, rollout: Rollout) -> None:
        # The agent sees an ordinary OpenAI base URL; the path carries the rollout and attempt to the server.
        base_url = f"{self.server_url}/rollouts/{rollout.rollout_id}/attempts/{rollout.attempt_id}/v1"
        start = time.time()
        try:
            answer = self.task.agent(rollout.task.input, base_url=base_url, model=self.model_name, api_key=self.api_key)
            reward, status, error = self.task.reward(rollout.task.input, answer), "succeeded", None
        except Exception as e:  # the agent's failure is the rollout's outcome, not the worker's
            answer, reward, status, error = None, 0.0, "failed", f"{type(e).__name__}: {e}"
        ids = {"rollout_id": rollout.rollout_id, "attempt_id": rollout.attempt_id}
        ray.get(self.store.add_spans.remote([
            Span(**ids, name=semconv.ROLLOUT, start_time=start, end_time=time.time(),
                 attributes={"task_id": rollout.task.task_id, "answer": answer, "status": status, "error": error}),
            Span(**ids, name=semconv.REWARD, attributes={semconv.REWARD_VALUE: reward}),
        ]))
        ray.get(self.store.complete.remote(rollout.rollout_id, status, reward, error))
