"""rollout/batching.py: calls made from many threads while one is in flight leave together, each caller gets its
own result, and a batch's error reaches the callers in that batch only."""

from __future__ import annotations

import threading

import pytest

from lightning_ray.rollout.batching import Coalesced


def test_calls_made_while_one_is_in_flight_leave_together_and_each_gets_its_own_result():
    batches, first_in_flight, release = [], threading.Event(), threading.Event()

    def send(items):
        batches.append(list(items))
        if len(batches) == 1:  # hold the first call until the others are waiting
            first_in_flight.set()
            assert release.wait(10)
        if "bad" in items:
            raise ValueError("the store refused the batch")
        return [f"got {i}" for i in items]

    call, results = Coalesced(send), {}

    def caller(item):
        try:
            results[item] = call(item)
        except ValueError as e:
            results[item] = e

    lead = threading.Thread(target=caller, args=("a",))
    lead.start()
    assert first_in_flight.wait(10)
    waiting = [threading.Thread(target=caller, args=(i,)) for i in ("b", "c", "bad")]
    for t in waiting:
        t.start()
    while len(call.pending) < 3:  # all three queued behind the call in flight
        threading.Event().wait(0.01)
    release.set()
    for t in (lead, *waiting):
        t.join(10)
    assert batches[0] == ["a"] and sorted(batches[1]) == ["b", "bad", "c"] and len(batches) == 2
    assert results["a"] == "got a"  # its batch went through; the next one failed, for its own callers only
    assert all(isinstance(results[i], ValueError) for i in ("b", "c", "bad"))


def test_a_lone_call_goes_at_once():
    call = Coalesced(lambda items: [i * 2 for i in items])
    assert [call(i) for i in range(3)] == [0, 2, 4]
    with pytest.raises(ValueError):
        Coalesced(lambda items: [])(1)  # a send that answers the wrong number of items is an error, not a hang
