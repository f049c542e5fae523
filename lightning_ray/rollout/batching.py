"""A worker's store calls, batched: the dequeues and verdicts its agent slots (threads) make at once reach the store
as one `dequeue_batch` / `finish_attempts` call. While one call is in flight the next ones wait, and leave together
when it returns; a lone call goes at once (no timer, so nothing waits that need not). Leases, retries under the same
attempt id and idempotency are the store's, unchanged: each slot still names its own attempt."""

from __future__ import annotations

import threading
from collections.abc import Callable

from lightning_ray.store.errors import StoreError
from lightning_ray.types import Rollout, Verdict, new_id


class Coalesced:
    """`send(items) -> results` (one per item, in order), called with whatever items threads brought meanwhile."""

    def __init__(self, send: Callable[[list], list]):
        self.send = send
        self.cond = threading.Condition()
        self.pending: list[_Call] = []
        self.sending = False

    def __call__(self, item):
        call = _Call(item)
        with self.cond:
            self.pending.append(call)
            while not call.finished:
                if self.sending:
                    self.cond.wait()
                    continue
                self.sending, batch, self.pending = True, self.pending, []  # this thread sends, its own call among them
                self.cond.release()
                try:
                    _deliver(batch, self.send)
                finally:
                    self.cond.acquire()
                    self.sending = False
                    self.cond.notify_all()  # the finished return; the first unfinished one sends what has gathered
        if call.error is not None:
            raise call.error
        return call.result


class _Call:
    def __init__(self, item):
        self.item, self.result, self.error, self.finished = item, None, None, False


def _deliver(batch: list[_Call], send: Callable[[list], list]) -> None:
    try:
        results = send([c.item for c in batch])
    except BaseException as e:  # the batch's error is each of its calls'
        for c in batch:
            c.error = e
    else:
        for c, r in zip(batch, results, strict=True):
            c.result = r
    for c in batch:
        c.finished = True


class BatchedStore:
    """A RolloutStore (store/protocol.py) whose `dequeue` and `finish_attempt`, called from many threads, are
    coalesced into the store's batch calls; every other call goes straight to `store`. One difference: asking again
    under an attempt id whose attempt already ended gets None (a slot that finds no rollout stops, and is sent again
    while rollouts wait), not StaleAttempt."""

    def __init__(self, store):
        self.store = store
        self._verdicts = Coalesced(store.finish_attempts)
        self._dequeues: dict[tuple[str | None, str], Coalesced] = {}
        self._lock = threading.Lock()

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    def dequeue(self, worker_id: str | None = None, attempt_id: str | None = None,
                queue: str = "default") -> Rollout | None:
        with self._lock:
            if (worker_id, queue) not in self._dequeues:
                self._dequeues[worker_id, queue] = Coalesced(
                    lambda ids: self.store.dequeue_batch(ids, worker_id, queue))
            dequeues = self._dequeues[worker_id, queue]
        return dequeues(attempt_id or new_id("at"))

    def finish_attempt(self, rollout_id: str, attempt_id: str, status: str, reward: float | None = None,
                       error: str | None = None) -> Rollout:
        outcome = self._verdicts(Verdict(rollout_id=rollout_id, attempt_id=attempt_id, status=status, reward=reward,
                                         error=error))
        if isinstance(outcome, StoreError):
            raise outcome
        return outcome
