"""Keeping the rollout workers busy until a set of rollouts has ended."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError
from tqdm import tqdm

from lightning_ray.metrics import count_error, metrics
from lightning_ray.types import FINISHED, Rollout

logger = logging.getLogger(__name__)
RESTART_TIMEOUT_S = 120  # how long a dead worker may take to come back (Ray restarts it) before the run stops
# Over every run_to_end of this process (an asynchronous run collects the next batch while the held-out evaluation
# runs, on the same workers): the work() calls running on each worker, by actor id, and the workers due a restart
_in_flight: Counter = Counter()
_worn: dict = {}  # actor id -> the worker
_restarting: set = set()
_lock = threading.Lock()


def run_to_end(store, workers: list, slots_per_worker: int, rollout_ids: list[str], desc: str) -> list[Rollout]:
    """Each worker runs `slots_per_worker` work() calls at once; each takes rollouts from the queue until it finds
    it empty. A slot that stopped is sent again as soon as a rollout waits in the queue, so an attempt the store
    requeued (it failed, timed out or its worker went silent) is taken by the next free slot, not after the slowest
    rollout of the set. A worker that died (Ray restarts it) loses its attempts to their leases, and the store
    retries them elsewhere; an error raised by work() itself is raised here. A worker worn out by agent threads it
    had to leave behind at timeouts gets no more rollouts, and is restarted once none of its own runs."""
    running: dict = {}  # call -> its worker
    free: list = []  # a worker per slot whose call has returned

    def send(worker) -> bool:
        """A work() call to the worker, unless it is due a restart (then False)."""
        with _lock:  # checked and counted at once: another set may be about to restart it
            if worker._actor_id in _worn or worker._actor_id in _restarting:
                return False
            _in_flight[worker._actor_id] += 1
        running[worker.work.remote(store)] = worker
        return True

    def collect(calls: list) -> None:
        for call in calls:
            worker = running.pop(call)
            try:
                ray.get(call)
                if ray.get(worker.worn_out.remote()):
                    with _lock:
                        _worn[worker._actor_id] = worker
            except RayActorError as e:
                logger.warning("a rollout worker died; its attempts are retried when their leases run out: %s", e)
                count_error("rollout", "worker_died")
                wait_restarted(worker)
            finally:  # once it has returned: till then it may run another set's rollouts
                with _lock:
                    _in_flight[worker._actor_id] -= 1
            free.append(worker)
        with _lock:  # none of its calls runs, this set's or another's; it gets none till restarted
            idle = [_worn.pop(a) for a in list(_worn) if not _in_flight[a]]
            _restarting.update(w._actor_id for w in idle)
        for worker in idle:
            logger.warning("restarting a rollout worker: its agent threads left behind at timeouts still run")
            count_error("rollout", "worker_restarted")
            try:
                restart(worker)
            finally:
                with _lock:
                    _restarting.discard(worker._actor_id)

    for w in workers:
        for _ in range(slots_per_worker):
            if not send(w):  # due a restart (another set's): sent once restarted
                free.append(w)

    total = len(set(rollout_ids))
    # a batch collected ahead (rollout.mode=async) runs in a thread, beside the update's spinner on the same line: the
    # loop shows that it waits for it, and the iteration's line what it collected
    ahead = threading.current_thread() is not threading.main_thread()
    with tqdm(total=len(rollout_ids), desc=desc, leave=False, disable=ahead) as bar:
        while True:
            # counted, not read: the ended rollouts themselves are read once, at the end
            counts = store.count_rollouts(rollout_ids)
            ended = sum(n for status, n in counts.items() if status in FINISHED)
            bar.update(ended - bar.n)
            if running:
                collect(ray.wait(list(running), num_returns=len(running), timeout=0)[0])
            if ended == total:
                collect(list(running))  # every slot finds the queue empty and returns
                metrics().queue_depth.set(0)
                return counted(store.get_rollouts(rollout_ids))
            waiting = counts.get("queued", 0) + counts.get("requeued", 0)
            metrics().queue_depth.set(waiting)
            for worker in list(free):
                if waiting and send(worker):
                    free.remove(worker)
                    waiting -= 1
            # until every slot has returned (the queue ran dry: the set is ending) or half a second has passed
            if running:
                ray.wait(list(running), num_returns=len(running), timeout=0.5)
            else:
                time.sleep(0.5)


def counted(rollouts: list[Rollout]) -> list[Rollout]:
    """Ended rollouts on the dashboard, by status; those the platform failed (no reward) also as errors."""
    for status, n in Counter(r.status for r in rollouts).items():
        metrics().rollouts.inc(n, tags={"status": status})
    count_error("rollout", "infra_failed", sum(r.reward is None for r in rollouts))
    return rollouts


def restart(worker) -> None:
    """Kill a worker's process and return once Ray has started a new one."""
    old = ray.get(worker.__ray_call__.remote(_pid))
    ray.kill(worker, no_restart=False)
    wait_restarted(worker, old)


def wait_restarted(worker, old_pid: int | None = None) -> None:
    """Return once Ray has restarted a dead worker (one whose process is not `old_pid`: ray.kill returns before the
    old process is gone, and until then it still answers); one that cannot come back stops the run."""
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while True:
        try:
            if ray.get(worker.__ray_call__.remote(_pid), timeout=max(deadline - time.monotonic(), 0)) != old_pid:
                return
        except ActorUnavailableError:  # still restarting
            pass
        except (ActorDiedError, GetTimeoutError) as e:
            raise RuntimeError("a rollout worker died and did not come back") from e
        if time.monotonic() > deadline:
            raise RuntimeError("a rollout worker died and did not come back")
        time.sleep(0.2)


def _pid(_actor) -> int:  # run inside an actor by __ray_call__
    return os.getpid()
