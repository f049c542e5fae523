"""Keeping the rollout workers busy until a set of rollouts has ended."""

from __future__ import annotations

import ray
from tqdm import tqdm

from lightning_ray.types import Rollout


def run_to_end(store, workers: list, slots_per_worker: int, rollout_ids: list[str], desc: str) -> list[Rollout]:
    """Each worker runs `slots_per_worker` work() calls at once; each takes rollouts from the queue until it finds
    it empty. A slot that stopped is sent again as soon as a rollout waits in the queue, so an attempt the store
    requeued (it failed, timed out or its worker went silent) is taken by the next free slot, not after the slowest
    rollout of the set. A worker's crash is raised here."""
    slots = {w.work.remote(): w for w in workers for _ in range(slots_per_worker)}  # call -> its worker
    with tqdm(total=len(rollout_ids), desc=desc, leave=False) as bar:
        while True:
            ended = len(store.wait_for_rollouts(rollout_ids, timeout=0.5))
            bar.update(ended - bar.n)
            idle, _ = ray.wait(list(slots), num_returns=len(slots), timeout=0)
            ray.get(idle)
            if ended == len(rollout_ids):
                ray.get(list(slots))
                return store.get_rollouts(rollout_ids)
            counts = store.count_rollouts(rollout_ids) if idle else {}
            for call in idle[:counts.get("queued", 0) + counts.get("requeued", 0)]:
                worker = slots.pop(call)
                slots[worker.work.remote()] = worker
