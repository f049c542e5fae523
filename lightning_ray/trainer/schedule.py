"""When each batch is collected. `rollout.mode=sync`: an iteration collects its batch, then updates, so the learner
waits for the slowest rollout and the rollouts for the update. `async`: the next `algorithm.max_staleness` batches'
rollouts run while the learner trains on this one (in threads: collecting is waiting on Ray), so part of a batch is
sampled by the policy one or more versions before the one it trains, which update.py bounds and the learner's
truncated importance weights (algorithm.tis_cap) correct. The same steps either way, scheduled two ways."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

from lightning_ray.terminal import status
from lightning_ray.trainer.collect import Batch, collect, draw
from lightning_ray.trainer.run import Run
from lightning_ray.types import Task


class Batches:
    def __init__(self, run: Run):
        self.run = run
        self.ahead = run.cfg.algorithm.max_staleness if run.cfg.rollout.mode == "async" else 0
        self.pool = ThreadPoolExecutor(self.ahead, thread_name_prefix="collect") if self.ahead else None
        self.pending: dict[int, Future] = {}
        self.lock = threading.Lock()
        self.collecting, self.idle_since = 0, time.monotonic()
        self.idle = {"learner": 0.0, "rollouts": 0.0}  # seconds the learner waited for a batch; none collected

    def take(self, iteration: int) -> Batch:
        """The iteration's batch: collected now (sync, or a first batch), or waited for (async: as the phase
        `wait`). Its phase timer goes on as the iteration's (run.phase)."""
        start, pending = time.monotonic(), self.pending.pop(iteration, None)
        if pending:
            with status(f"iter {iteration}: waiting for its rollouts, collected during the update", report=False):
                batch = pending.result()
        else:
            batch = self._collect(iteration, self._begin(iteration))
        waited = time.monotonic() - start
        if pending:
            batch.phase.add("wait", waited)
        self.idle["learner"] += waited
        self.run.phase = batch.phase
        return batch

    def start_after(self, iteration: int) -> None:
        """async: the collection of the batches up to `max_staleness` past this iteration, while it trains."""
        for ahead in range(iteration + 1, min(iteration + 1 + self.ahead, self.run.cfg.trainer.iterations)):
            if ahead not in self.pending:
                self.pending[ahead] = self.pool.submit(self._collect, ahead, self._begin(ahead))

    def idle_seconds(self) -> dict[str, float]:
        """Since the last call: how long the learner waited for a batch, and how long no batch was collecting
        (rollout workers and engines waiting for the learner)."""
        with self.lock:
            self._count_idle()
            idle, self.idle = {k: round(v, 3) for k, v in self.idle.items()}, {"learner": 0.0, "rollouts": 0.0}
            return idle

    def _begin(self, iteration: int) -> list[Task]:
        """A batch's start, in the loop's thread: its time (started[i]: its spans are all after it) and its tasks
        (the sampler's state, which a checkpoint keeps, changes in this thread only)."""
        self.run.started.append(time.time())
        self.run.sampler_before[iteration] = self.run.rng.getstate()
        for old in [i for i in self.run.sampler_before if i < iteration - self.ahead]:  # 24 kB each, read by the
            del self.run.sampler_before[old]  # checkpoint after the iteration before it only (Run.state)
        return draw(self.run)

    def _collect(self, iteration: int, tasks: list[Task]) -> Batch:
        with self.lock:
            self._count_idle()
            self.collecting += 1
        try:
            return collect(self.run, iteration, tasks)
        finally:
            with self.lock:
                self._count_idle()
                self.collecting -= 1

    def _count_idle(self) -> None:
        """Adds the time since the last count to the rollouts' idle time if no batch was collecting (under the lock)."""
        now = time.monotonic()
        if not self.collecting:
            self.idle["rollouts"] += now - self.idle_since
        self.idle_since = now

    def __enter__(self) -> Batches:
        return self

    def cancel_ahead(self) -> None:
        """Batches collected ahead of a run's end (its time budget, an error) are not trained: their unfinished
        rollouts are cancelled, so their collection ends (what it raises then concerns no one). An agent still
        running a cancelled rollout is given a minute to return."""
        if self.pending:
            store = self.run.services.store
            if left := store.query_rollouts(status=["queued", "requeued", "running"]):
                store.cancel([r.rollout_id for r in left])
            wait(self.pending.values(), timeout=60)
            self.pending.clear()

    def __exit__(self, *exc) -> None:
        """Batches collected ahead are cancelled (cancel_ahead) before the services stop under them."""
        self.cancel_ahead()
        if self.pool:
            self.pool.shutdown(wait=False, cancel_futures=True)
