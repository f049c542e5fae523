"""The trace store: the rollout lifecycle (leases, heartbeats, timeouts, retries), spans, durability, shards."""

from __future__ import annotations

import math
import os
import random
import sqlite3
import threading
import time

import msgspec
import numpy as np
import pytest
import ray

from lightning_ray.rollout.batching import BatchedStore
from lightning_ray.store.client import StoreClient
from lightning_ray.store.errors import (BatchTooLarge, InvalidReward, InvalidSpans, InvalidTransition, StaleAttempt,
                                       UnknownAttempt, UnknownRollout)
from lightning_ray.store.rows import span_row
from lightning_ray.store.sqlite import SQLiteBackend
from lightning_ray.tracing.spans import new_span_id
from lightning_ray.types import AttemptPolicy, Rollout, Span, Task, Verdict


def wait_until(done, what: str, timeout: float = 60.0) -> None:
    """Poll for a state under a deadline generous for a loaded machine, rather than sleeping a guessed duration."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"waited {timeout:g} s for {what}"
        time.sleep(0.05)


def rollouts(n: int, **config) -> list[Rollout]:
    return [Rollout(rollout_id=f"r{i}", task=Task(task_id=f"t{i}", input={"i": i}), config=AttemptPolicy(**config))
            for i in range(n)]


def test_queue_is_first_in_first_out_and_each_rollout_is_leased_once():
    store = SQLiteBackend()
    assert store.enqueue(rollouts(3)) == 3
    assert store.enqueue(rollouts(3)) == 0  # a re-sent enqueue is not duplicated
    leased = [store.dequeue("w", now=0.0) for _ in range(4)]
    assert [r.rollout_id for r, _ in leased[:3]] == ["r0", "r1", "r2"] and leased[3] is None
    for rollout, attempt in leased[:3]:
        assert rollout.status == "running" and rollout.attempt_id == attempt.attempt_id and attempt.sequence == 1
        assert attempt.worker_id == "w" and store.get_rollouts([rollout.rollout_id])[0] == rollout


def test_span_retention_keeps_the_spans_file_from_growing(tmp_path):
    """store.keep_iterations: after each iteration the trainer deletes the spans of rollouts enqueued before the
    oldest iteration it keeps. Over 30 iterations of 20 rollouts × 5 spans of ~8 KB, keeping 3, the spans file
    stops growing once SQLite reuses the freed pages; the kept iterations' spans are all there, no older one is."""
    store, keep = SQLiteBackend(tmp_path / "traces.sqlite"), 3
    spans_file = [tmp_path / "traces-spans.sqlite", tmp_path / "traces-spans.sqlite-wal"]
    sizes = []
    for iteration in range(30):
        batch = [Rollout(rollout_id=f"r{iteration}-{i}", task=Task(task_id=f"t{i}", input={}), enqueued_at=iteration)
                 for i in range(20)]
        store.enqueue(batch)
        store.add_span_rows([span_row(Span(rollout_id=r.rollout_id, name="llm.call", attributes={"text": "x" * 8000}))
                             for r in batch for _ in range(5)], "server")
        if iteration >= keep:
            store.delete_spans(before=iteration - keep + 1)
        store.checkpoint()
        sizes.append(sum(f.stat().st_size for f in spans_file if f.exists()))
    kept = {s.rollout_id.split("-")[0] for s in store.query_spans()}
    assert kept == {f"r{i}" for i in range(30 - keep, 30)} and len(store.query_spans()) == keep * 20 * 5
    assert len(store.query_rollouts()) == 30 * 20  # the rollouts themselves stay
    assert max(sizes[10:]) <= sizes[9] * 1.05, sizes  # without deletions: ~0.8 MB more every iteration
    # a cut reads the rollouts since the last one only (every rollout ever stored: 1 s a cut at 1M): a span of an
    # older rollout that came late, started before that cut, goes by its time at the next
    store.add_span_rows([span_row(Span(rollout_id="r0-0", name="llm.call", start_time=1.0))], "server")
    assert store.delete_spans(before=29 - keep + 1) == 1 and len(store.query_spans()) == keep * 20 * 5


def test_a_worker_takes_rollouts_of_its_own_queue_only(tmp_path):
    """A training run's workers dequeue from the run's queue: rollouts enqueued for other workers (the store API's
    "default" queue, say) are never theirs, nor theirs the others'. A file from before queues reads as "default"."""
    store = SQLiteBackend()
    store.enqueue([r.model_copy(update={"queue": "run@a"}) for r in rollouts(2)])
    store.enqueue([Rollout(rollout_id="outside", task=Task(task_id="o", input={}))])
    assert [store.dequeue("w", now=0.0, queue="run@a")[0].rollout_id for _ in range(2)] == ["r0", "r1"]
    assert store.dequeue("w", now=0.0, queue="run@a") is None
    assert store.dequeue("w", now=0.0, queue="run@b") is None
    leased, _ = store.dequeue("w", now=0.0)
    assert (leased.rollout_id, leased.queue) == ("outside", "default")
    old = tmp_path / "old.sqlite"
    db = sqlite3.connect(old)
    db.execute("CREATE TABLE rollouts (rollout_id TEXT PRIMARY KEY, seq INTEGER NOT NULL, task TEXT NOT NULL, "
               "config TEXT NOT NULL, status TEXT NOT NULL, attempt_id TEXT, attempts INTEGER NOT NULL, reward REAL, "
               "error TEXT, enqueued_at REAL NOT NULL, ended_at REAL)")
    db.execute("INSERT INTO rollouts VALUES ('r', 1, ?, ?, 'queued', NULL, 0, NULL, NULL, 0, NULL)",
               (Task(task_id="t", input={}).model_dump_json(), AttemptPolicy().model_dump_json()))
    db.commit()
    db.close()
    assert SQLiteBackend(old).dequeue("w", now=1.0)[0].queue == "default"


def test_failed_attempts_are_retried_up_to_max_attempts():
    store = SQLiteBackend()
    store.enqueue(rollouts(1, max_attempts=3))
    statuses = []
    for _ in range(3):
        rollout, attempt = store.dequeue(None, now=0.0)
        statuses.append(store.finish_attempt(attempt.attempt_id, "failed", now=1.0, error="boom").status)
    assert statuses == ["requeued", "requeued", "failed"]
    assert store.dequeue(None, now=2.0) is None
    attempts = store.get_attempts("r0")
    assert [(a.sequence, a.status) for a in attempts] == [(1, "failed"), (2, "failed"), (3, "failed")]
    assert store.get_rollouts(["r0"])[0].error == "boom"


def test_retry_condition_decides_which_failures_are_retried():
    store = SQLiteBackend()
    store.enqueue(rollouts(1, max_attempts=5, retry_on=["timeout"]))
    _, attempt = store.dequeue(None, now=0.0)
    assert store.finish_attempt(attempt.attempt_id, "failed", now=1.0).status == "failed"  # not a timeout: final


def test_a_failure_the_policy_caused_is_scored_and_never_retried():
    """A failed attempt with a reward (the agent crashed on the policy's answer: 0) ends the rollout; retrying it
    would replace the 0 by a luckier try and bias the data towards success. One without (the platform's) retries."""
    store = SQLiteBackend()
    store.enqueue(rollouts(2, max_attempts=3))
    (_, policy), (_, platform) = store.dequeue(None, now=0.0), store.dequeue(None, now=0.0)
    ended = store.finish_attempt(policy.attempt_id, "failed", now=1.0, reward=0.0, error="ValueError: bad answer")
    assert (ended.status, ended.reward) == ("failed", 0.0)
    assert store.finish_attempt(platform.attempt_id, "failed", now=1.0, error="APIConnectionError").status == "requeued"
    retry, _ = store.dequeue(None, now=2.0)
    assert retry.rollout_id == "r1" and store.dequeue(None, now=2.0) is None


def test_success_ends_the_rollout_with_its_reward():
    store = SQLiteBackend()
    store.enqueue(rollouts(1, max_attempts=2))
    _, attempt = store.dequeue(None, now=0.0)
    done = store.finish_attempt(attempt.attempt_id, "succeeded", now=1.0, reward=0.5)
    assert (done.status, done.reward, done.ended_at) == ("succeeded", 0.5, 1.0)


def test_every_state_change_is_validated():
    store = SQLiteBackend()
    store.enqueue(rollouts(2))
    _, attempt = store.dequeue(None, now=0.0)
    store.finish_attempt(attempt.attempt_id, "succeeded", now=1.0, reward=1.0)
    with pytest.raises(StaleAttempt):
        store.finish_attempt(attempt.attempt_id, "failed", now=2.0)  # an ended attempt cannot change its verdict
    assert store.cancel(["r0"], now=2.0) == {"r0": "already_ended"}  # a verdict stands
    with pytest.raises(InvalidTransition):
        store.enqueue([rollouts(1)[0].model_copy(update={"rollout_id": "x", "status": "running"})])
    _, second = store.dequeue(None, now=0.0)
    with pytest.raises(InvalidTransition, match="'running' to 'queued'"):
        store.finish_attempt(second.attempt_id, "queued", now=1.0)
    with pytest.raises(UnknownAttempt):
        store.heartbeat("at-nope", now=1.0)
    with pytest.raises(UnknownRollout):
        store.get_rollouts(["nope"], strict=True)
    assert store.get_rollouts(["r1"])[0].status == "running"  # a rejected change leaves the state as it was


def test_cancel_reports_per_rollout_and_a_second_cancel_changes_nothing():
    """One unknown or ended rollout in the list does not stop the others being cancelled."""
    store = SQLiteBackend()
    store.enqueue(rollouts(3))
    _, running = store.dequeue(None, now=0.0)
    _, done = store.dequeue(None, now=0.0)
    store.finish_attempt(done.attempt_id, "succeeded", now=1.0, reward=1.0)
    ids = ["r0", "r1", "ghost", "r2", "r2"]
    assert store.cancel(ids, now=2.0) == {"r0": "cancelled", "r1": "already_ended", "ghost": "unknown",
                                          "r2": "cancelled"}
    assert [(r.status, r.ended_at) for r in store.get_rollouts(["r0", "r1", "r2"])] == [
        ("cancelled", 2.0), ("succeeded", 1.0), ("cancelled", 2.0)]
    assert [(a.status, a.error) for a in store.get_attempts("r0")] == [("failed", "rollout cancelled")]
    assert store.cancel(ids, now=3.0) == {"r0": "already_ended", "r1": "already_ended", "ghost": "unknown",
                                          "r2": "already_ended"}
    assert [r.ended_at for r in store.get_rollouts(["r0", "r2"])] == [2.0, 2.0]  # the second cancel is a no-op


def test_dequeue_under_the_same_attempt_id_gets_the_same_lease_back():
    """A worker whose reply was lost asks again under its attempt id: it gets the rollout the store leased to it,
    not the next one (which stranded the first until its lease ran out, and failed it with max_attempts=1)."""
    store = SQLiteBackend()
    store.enqueue(rollouts(2, unresponsive_seconds=5))
    first = store.dequeue("w", now=0.0, attempt_id="at-mine")
    assert first[1].attempt_id == "at-mine" and first[0].attempt_id == "at-mine"
    assert store.dequeue("w", now=1.0, attempt_id="at-mine") == first
    assert store.count_rollouts() == {"running": 1, "queued": 1} and len(store.get_attempts("r0")) == 1
    assert store.dequeue("w", now=1.0)[0].rollout_id == "r1"  # without an id: a fresh lease, as before
    store.expire(now=6.0)  # both leases ran out: the attempt under that id is over
    with pytest.raises(StaleAttempt, match="at-mine"):
        store.dequeue("w", now=7.0, attempt_id="at-mine")


def test_a_batch_of_dequeues_and_verdicts_is_one_transaction_each_with_the_same_rules():
    """dequeue_batch leases the oldest rollouts in order, gives an id asked again its lease back and an ended one
    None; finish_attempts takes each verdict as finish_attempt would, and one that is refused changes nothing."""
    store = SQLiteBackend()
    store.enqueue(rollouts(3, unresponsive_seconds=5))
    first = store.dequeue_batch("w", 0.0, ["a0", "a1"])
    assert [(r.rollout_id, a.attempt_id) for r, a in first] == [("r0", "a0"), ("r1", "a1")]
    again = store.dequeue_batch("w", 1.0, ["a1", "a2", "a3"])  # a1's reply was lost; a3 finds the queue empty
    assert again[0] == first[1] and again[1][0].rollout_id == "r2" and again[2] is None
    assert store.count_rollouts() == {"running": 3}
    outcomes = store.finish_attempts([
        Verdict(rollout_id="r0", attempt_id="a0", status="succeeded", reward=1.0),
        Verdict(rollout_id="r1", attempt_id="a1", status="succeeded", reward=math.inf),  # refused: stays running
        Verdict(rollout_id="r2", attempt_id="a0", status="failed"),  # another rollout's attempt: refused
        Verdict(rollout_id="r2", attempt_id="a2", status="failed", reward=0.0)], now=2.0)
    assert [type(o).__name__ for o in outcomes] == ["Rollout", "InvalidReward", "UnknownAttempt", "Rollout"]
    assert (outcomes[0].status, outcomes[0].reward, outcomes[3].status) == ("succeeded", 1.0, "failed")
    assert {r.rollout_id: r.status for r in store.get_rollouts(["r0", "r1", "r2"])} == {
        "r0": "succeeded", "r1": "running", "r2": "failed"}
    [stale] = store.finish_attempts([Verdict(rollout_id="r0", attempt_id="a0", status="succeeded", reward=0.0)], 3.0)
    assert isinstance(stale, StaleAttempt) and store.get_rollouts(["r0"])[0].reward == 1.0
    store.expire(now=9.0)  # a1's lease ran out: asking again under it gets nothing
    assert store.dequeue_batch("w", 10.0, ["a1"]) == [None]


def test_a_workers_slots_share_batched_calls_over_ray(ray_cluster):
    """Through the Ray client and BatchedStore, as a rollout worker's slots use it: every rollout run exactly once,
    in fewer store calls than rollouts; with two shards (one call per attempt) the same."""
    for shards in (1, 2):
        store = StoreClient.start(num_shards=shards)
        made = store.enqueue([Task(task_id=f"t{i}", input={}) for i in range(200)])
        calls = []

        class Counting:  # the store, counting the batch calls that reach it
            def dequeue_batch(self, ids, worker_id=None, queue="default"):
                calls.append(len(ids))
                return store.dequeue_batch(ids, worker_id, queue)

            def finish_attempts(self, verdicts):
                calls.append(len(verdicts))
                return store.finish_attempts(verdicts)

        batched, ran = BatchedStore(Counting()), []

        def slot():
            while (r := batched.dequeue("w")) is not None:
                ran.append(batched.finish_attempt(r.rollout_id, r.attempt_id, "succeeded", 1.0).rollout_id)

        threads = [threading.Thread(target=slot) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(ran) == sorted(r.rollout_id for r in made)
        assert {r.status for r in store.get_rollouts([r.rollout_id for r in made])} == {"succeeded"}
        assert sum(calls) >= 400 and len(calls) < 400 and max(calls) > 1, calls  # batched, every call counted
        store.close()


def test_timeouts_and_lost_leases_end_attempts_and_retry_them():
    store = SQLiteBackend()
    store.enqueue([*rollouts(1, timeout_seconds=10, max_attempts=2, timeout_policy="platform"),
                   Rollout(rollout_id="quiet", task=Task(task_id="q", input={}),
                           config=AttemptPolicy(unresponsive_seconds=2)),
                   Rollout(rollout_id="loops", task=Task(task_id="l", input={}),
                           config=AttemptPolicy(timeout_seconds=10, max_attempts=2))])  # timeout_policy: policy
    _, slow = store.dequeue(None, now=0.0)
    _, quiet = store.dequeue(None, now=0.0)
    store.dequeue(None, now=0.0)
    store.heartbeat(quiet.attempt_id, now=1.5)  # the lease now runs to 3.5
    assert store.expire(now=3.0) == []
    assert sorted(store.expire(now=11.0)) == ["loops", "quiet", "r0"]
    assert [a.status for a in store.get_attempts("r0")] == ["timeout"]
    assert store.get_rollouts(["r0"])[0].status == "requeued"  # the platform's timeout: one attempt left
    loops = store.get_rollouts(["loops"])[0]
    assert (loops.status, loops.reward) == ("failed", 0.0)  # the policy's timeout: scored, not retried
    assert [a.status for a in store.get_attempts("quiet")] == ["unresponsive"]
    assert store.get_rollouts(["quiet"])[0].status == "failed"
    with pytest.raises(StaleAttempt):
        store.heartbeat(quiet.attempt_id, now=12.0)  # a worker that comes back learns it lost the lease


def test_spans_are_idempotent_validated_and_survive_reopening(tmp_path):
    path = tmp_path / "t.sqlite"
    store = SQLiteBackend(path)
    store.enqueue(rollouts(1))
    spans = [Span(rollout_id="r0", attempt_id="a", name="llm.call", start_time=i,
                  attributes={"ids": list(range(i)), "model": "m"}) for i in range(5)]
    assert store.add_span_rows([span_row(s) for s in spans])["accepted"] == 5
    again = store.add_span_rows([span_row(s) for s in spans[:2]])
    assert (again["accepted"], again["duplicates"]) == (0, 2)
    bad = store.add_span_rows([span_row(Span(rollout_id="ghost", name="x")), ("too", "short"),
                               span_row(Span(rollout_id="r0", name="ok", start_time=9)),
                               (*span_row(Span(name="y", start_time=5))[:7], 1.0, *span_row(Span(name="y"))[8:])])
    assert (bad["accepted"], bad["rejected"]) == (1, 3)
    assert any("unknown rollout_id 'ghost'" in e for e in bad["errors"])
    assert any("end_time" in e for e in bad["errors"]) and any("not a span row" in e for e in bad["errors"])
    del store
    reopened = SQLiteBackend(path)
    assert [s.span_id for s in reopened.query_spans(["r0"], name="llm.call")] == [s.span_id for s in spans]
    assert reopened.query_spans(["r0"])[3] == spans[3]
    assert [s.start_time for s in reopened.query_spans(since=1, until=3)] == [1, 2]
    assert [s.name for s in reopened.query_spans(["r0"], name=["ok", "llm.call"])] == ["llm.call"] * 5 + ["ok"]
    assert len(reopened.query_spans(attempt_id="a", limit=2)) == 2


def test_numeric_lists_are_packed_and_read_back_exactly(tmp_path):
    """Lists of plain ints or floats are stored as packed arrays: they come back as numpy arrays of the same values
    (int32 where all fit, else int64; float64 bit for bit), in the same key order; anything else (bools, mixed, too
    big for int64, nested) stays JSON, as before. A span read back stores exactly as it was first stored."""
    store = SQLiteBackend(tmp_path / "t.sqlite")
    store.enqueue(rollouts(1))
    attributes = {"prompt_ids": [151_643, 0, 2**31 - 1, -(2**31)], "big": [2**31, -(2**63)], "huge": [2**64],
                  "logprobs": [-0.1, -1e-300, 5e-324, -1234.56789012345678, float("-inf"), -0.0],
                  "flags": [True, False], "mixed": [1, 2.5], "nested": [[1, 2]], "empty": [], "name": "x", "n": 3}
    row = span_row(Span(rollout_id="r0", name="llm.call", attributes=attributes))
    assert b'"prompt_ids":null' in row[10] and b'"flags":[true,false]' in row[10]
    store.add_span_rows([row])
    [back] = SQLiteBackend(tmp_path / "t.sqlite").query_spans(["r0"])
    arrays = {k: v for k, v in back.attributes.items() if isinstance(v, np.ndarray)}
    assert {k: v.dtype.str for k, v in arrays.items()} == {"prompt_ids": "<i4", "big": "<i8", "logprobs": "<f8"}
    assert {**back.attributes, **{k: v.tolist() for k, v in arrays.items()}} == attributes
    assert list(back.attributes) == list(attributes) and [type(v) for v in back.attributes["flags"]] == [bool] * 2
    assert str(back.attributes["logprobs"][-1]) == "-0.0"  # bit for bit, sign of zero included
    assert not arrays["prompt_ids"].flags.writeable  # a view of the row's bytes, not a copy
    assert back == Span(**{**back.model_dump(), "attributes": attributes})  # arrays equal the lists they came from
    assert span_row(back) == row
    nan = span_row(Span(rollout_id="r0", name="nan", attributes={"logprobs": [float("nan")]}))
    store.add_span_rows([nan])
    assert math.isnan(store.query_spans(["r0"], name="nan")[0].attributes["logprobs"][0])  # JSON made it null


def test_a_spans_file_from_before_packed_arrays_still_reads(tmp_path):
    """Its rows have their lists in the JSON and no `arrays` column: the column is added, the rows read as before."""
    path = tmp_path / "t.sqlite"
    store = SQLiteBackend(path)
    store.enqueue(rollouts(1))
    span = Span(rollout_id="r0", name="llm.call", attributes={"ids": [1, 2, 3], "logprobs": [-0.5]})
    old_row = (*span_row(span)[:10], msgspec.json.encode(span.attributes), b"[]")  # as the old span_row made it
    store.db.execute("ALTER TABLE span_db.spans DROP COLUMN arrays")
    store.db.execute("INSERT INTO span_db.spans (span_id, trace_id, parent_id, rollout_id, attempt_id, name, "
                     "start_time, end_time, status, status_message, attributes, events) VALUES "
                     "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", old_row)
    store.db.close()
    reopened = SQLiteBackend(path)
    new = Span(rollout_id="r0", name="llm.call", start_time=span.start_time + 1, attributes={"ids": [4]})
    assert reopened.add_span_rows([span_row(new)])["accepted"] == 1
    assert reopened.query_spans(["r0"]) == [span, new]


def test_spans_are_keyed_by_rollout_and_span_id():
    """Two rollouts may carry the same span id (an agent that seeds `random` per task once gave every rollout the
    same ids): both are kept; a re-sent span of the same rollout is still a duplicate."""
    store = SQLiteBackend()
    store.enqueue(rollouts(2))
    same = [span_row(Span(span_id="00000000000000aa", rollout_id=r, name="llm.call")) for r in ("r0", "r1")]
    assert store.add_span_rows(same)["accepted"] == 2
    assert store.add_span_rows(same[:1])["duplicates"] == 1
    assert [len(store.query_spans([r])) for r in ("r0", "r1")] == [1, 1]
    random.seed(0)
    first = new_span_id()
    random.seed(0)
    assert new_span_id() != first  # the tracer's ids do not follow the agent's seed


def test_rollouts_are_queried_by_status_and_time():
    store = SQLiteBackend()
    store.enqueue([r.model_copy(update={"enqueued_at": float(i)}) for i, r in enumerate(rollouts(4))])
    store.dequeue(None, now=5.0)
    assert [r.rollout_id for r in store.query_rollouts(status=["queued"])] == ["r1", "r2", "r3"]
    assert [r.rollout_id for r in store.query_rollouts(since=1, until=3)] == ["r1", "r2"]
    assert store.count_rollouts() == {"queued": 3, "running": 1}


# --- the actor and the client, on a real Ray cluster -------------------------------------------------------


def test_nothing_acknowledged_is_lost_when_the_store_is_killed_mid_run(ray_cluster, tmp_path):
    client = StoreClient.start(tmp_path)
    [rollout] = client.enqueue([Task(task_id="t", input={})])
    acknowledged, stop = [], threading.Event()

    def writer():  # keeps sending batches; Ray retries the ones in flight when the actor dies
        while not stop.is_set():
            batch = [Span(rollout_id=rollout.rollout_id, name="tool", attributes={"i": i}) for i in range(50)]
            client.add_spans(batch)
            acknowledged.extend(s.span_id for s in batch)

    def pid() -> int:
        return ray.get(client.shards[0].__ray_call__.remote(lambda store: os.getpid()))

    thread = threading.Thread(target=writer)
    thread.start()
    before = pid()
    wait_until(lambda: len(acknowledged) > 100, "the writer's first batches")
    ray.kill(client.shards[0], no_restart=False)  # the actor process dies mid-stream; Ray restarts it
    wait_until(lambda: pid() != before, "the restarted store")
    at_restart = len(acknowledged)
    wait_until(lambda: len(acknowledged) > at_restart + 100, "batches acknowledged by the restarted store")
    stop.set()
    thread.join(timeout=60)
    resent = client.add_spans([Span(rollout_id=rollout.rollout_id, name="tool", span_id=i) for i in acknowledged[:100]])
    assert resent["duplicates"] == 100 and resent["accepted"] == 0
    stored = [s.span_id for s in client.query_spans([rollout.rollout_id])]
    assert len(acknowledged) > 100 and len(stored) == len(set(stored))
    assert set(acknowledged) <= set(stored)
    assert client.get_rollouts([rollout.rollout_id])[0].status == "queued"


def test_store_rejects_bad_input_counts_it_and_keeps_serving(ray_cluster):
    client = StoreClient.start(max_batch_spans=10)
    with pytest.raises(UnknownRollout, match="ghost"):
        client.add_spans([Span(rollout_id="ghost", name="x")])
    with pytest.raises(InvalidSpans, match="end_time"):
        client.add_spans([Span(name="x", start_time=2, end_time=1)])
    assert ray.get(client.shards[0].add_spans.remote([("junk",)]))["rejected"] == 1  # raw rows, straight in
    with pytest.raises(BatchTooLarge):
        client.add_spans([Span(name="x") for _ in range(11)])
    with pytest.raises(UnknownAttempt):
        client.heartbeat("r", "at-nope")
    assert client.add_spans([Span(name="fine")])["accepted"] == 1
    assert client.stats()["errors"] == {"invalid_spans": 3, "batch_too_large": 1, "attempt_not_found": 1}


def test_rewards_that_are_not_finite_are_refused_inside_ray_too(ray_cluster):
    """The store's own client (what workers and the HTTP API use): a NaN or infinite verdict is refused before
    anything changes (the attempt runs on, and a finite verdict is taken); a reward span holding one is rejected and
    counted, the batch's other spans stored."""
    client = StoreClient.start()
    [rollout] = client.enqueue([Task(task_id="t", input={})])
    leased = client.dequeue("w")
    for bad in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(InvalidReward, match="not a finite number"):
            client.finish_attempt(rollout.rollout_id, leased.attempt_id, "succeeded", bad)
    assert [a.status for a in client.get_attempts(rollout.rollout_id)] == ["running"]
    assert client.finish_attempt(rollout.rollout_id, leased.attempt_id, "succeeded", 0.5).reward == 0.5
    ok = Span(rollout_id=rollout.rollout_id, name="reward", attributes={"lightning_ray.reward": 1.0})
    infinite = Span(rollout_id=rollout.rollout_id, name="reward", attributes={"lightning_ray.reward": float("inf")})
    nan_dimension = Span(rollout_id=rollout.rollout_id, name="reward",
                         attributes={"lightning_ray.reward": 1.0, "lightning_ray.reward.format": float("nan")})
    with pytest.raises(InvalidSpans, match="not a finite number"):
        client.add_spans([infinite])
    result = client.add_spans([ok, infinite, nan_dimension], strict=False)
    assert (result["accepted"], result["rejected"]) == (1, 2)
    assert [s.attributes for s in client.query_spans([rollout.rollout_id])] == [{"lightning_ray.reward": 1.0}]
    assert client.stats()["errors"] == {"invalid_reward": 3, "invalid_spans": 3}


def test_a_reward_that_is_not_finite_fails_the_attempt_without_a_reward(ray_cluster):
    """A task's reward function that returns NaN, or an agent that emits an infinite reward: the rollout fails for the
    platform's reasons, with no reward (so training leaves it out), saying why; nothing non-finite is stored."""
    from lightning_ray import tracing
    from lightning_ray.rollout.runner import run_attempt

    client = StoreClient.start()
    ids = [r.rollout_id for r in client.enqueue([Task(task_id="nan", input={"emits": False}),
                                                  Task(task_id="emitted", input={"emits": True})])]

    def agent(task, **openai_settings):  # no LLM here
        if task["emits"]:
            tracing.emit_reward({"correct": float("inf")})  # raises ValueError: the agent fails, as on any bug
        return "answer"

    for reward in (lambda task, answer: float("nan"), lambda task, answer: 1.0):  # in the queue's order
        run_attempt(client, client.dequeue("w"), agent, reward, "http://unused", "m")
    nan, emitted = client.get_rollouts(ids)
    assert (nan.status, nan.reward) == ("failed", None) and "returned nan, not a finite number" in nan.error
    assert (emitted.status, emitted.reward) == ("failed", 0.0) and "rewards must be finite" in emitted.error
    rewards = [s.attributes["lightning_ray.reward"] for s in client.query_spans(ids, name="reward")]
    assert rewards == [0.0]  # the emitting agent's failure, scored as every agent error is; no NaN, no inf
    # a reward function of the wrong type, or one that raises, is as much its own fault: said so, not trained on (a
    # TypeError escaped to the spans' hand-over, "its spans did not all reach the store"; a raise scored 0)
    def raises(task, answer):
        raise KeyError("answer")

    said = {"1": "returned '1', not a finite number", None: "returned None, not a finite number",
            raises: "the task's reward function raised KeyError: 'answer'", True: None}
    ids = [r.rollout_id for r in client.enqueue([Task(task_id=f"r{i}", input={"emits": False}) for i in range(4)])]
    for value in said:
        run_attempt(client, client.dequeue("w"), agent, value if callable(value) else lambda t, a, v=value: v,
                    "http://unused", "m")
    for rollout, (value, error) in zip(client.get_rollouts(ids), said.items()):
        if error is None:  # a bool is a number: a reward function that returns `answer == gold`
            assert (rollout.status, rollout.reward) == ("succeeded", 1.0)
        else:
            assert (rollout.status, rollout.reward) == ("failed", None) and error in rollout.error, rollout.error


def test_a_refused_span_or_an_agents_base_exception_ends_the_attempt_with_its_verdict(ray_cluster):
    """One span the store refuses (an empty name, as OpenTelemetry allows) is dropped and the rest of the trace
    stored; an agent raising what is not an Exception (a CancelledError escaping its asyncio code) fails its own
    rollout, scored 0. Before, both escaped run_attempt: no verdict, and over Ray the training run stopped. The
    task's reward span is marked as the task's, so task.agent_rewards takes the agent's own, not it."""
    import asyncio

    from lightning_ray import tracing
    from lightning_ray.rollout.runner import run_attempt

    client = StoreClient.start()
    ids = [r.rollout_id for r in client.enqueue([Task(task_id="bad-span", input={"cancel": False}),
                                                  Task(task_id="cancelled", input={"cancel": True})])]

    def agent(task, **openai_settings):  # no LLM here
        if task["cancel"]:
            raise asyncio.CancelledError()
        with tracing.span(""):
            pass
        tracing.emit_reward(0.9)
        return "answer"

    for _ in ids:
        run_attempt(client, client.dequeue("w"), agent, lambda task, answer: 0.0, "http://unused", "m")
    bad_span, cancelled = client.get_rollouts(ids)
    assert (bad_span.status, bad_span.reward) == ("succeeded", 0.0)
    assert (cancelled.status, cancelled.reward) == ("failed", 0.0) and "CancelledError" in cancelled.error
    rewards = [(s.attributes["lightning_ray.reward"], s.attributes.get("lightning_ray.reward.task"))
               for s in client.query_spans([ids[0]], name="reward")]
    assert rewards == [(0.9, None), (0.0, True)]
    assert client.stats()["errors"]["invalid_spans"] == 1


def test_waiting_for_rollouts_and_expiring_silent_attempts(ray_cluster):
    client = StoreClient.start(expire_every_s=0.05)
    # Only the second rollout has a lease: 2 s, so its retry's outlasts the waiter's 0.3 s below on a loaded machine.
    ids = [client.enqueue([Task(task_id="t0", input={})], AttemptPolicy(max_attempts=2))[0].rollout_id,
           client.enqueue([Task(task_id="t1", input={})],
                          AttemptPolicy(unresponsive_seconds=2.0, max_attempts=2))[0].rollout_id]
    first, second = client.dequeue("w"), client.dequeue("w")
    assert client.wait_for_rollouts(ids, timeout=0.2) == []  # nothing ended yet: the timeout returns
    client.finish_attempt(first.rollout_id, first.attempt_id, "succeeded", reward=1.0)
    # the second worker went silent: its lease expires and the rollout is offered again
    wait_until(lambda: client.get_attempts(second.rollout_id)[0].status != "running", "the silent lease to expire")
    assert [a.status for a in client.get_attempts(second.rollout_id)] == ["unresponsive"]
    retry = client.dequeue("w2")
    assert retry.rollout_id == second.rollout_id and retry.attempts == 2
    with pytest.raises(StaleAttempt):
        client.finish_attempt(second.rollout_id, second.attempt_id, "succeeded")
    waiter = threading.Thread(target=lambda: time.sleep(0.3) or client.finish_attempt(
        retry.rollout_id, retry.attempt_id, "succeeded", reward=0.0))
    waiter.start()
    ended = client.wait_for_rollouts(ids, timeout=30)
    waiter.join()
    assert sorted(r.rollout_id for r in ended) == sorted(ids) and all(r.status == "succeeded" for r in ended)


def test_shards_split_rollouts_by_id_and_queries_merge(ray_cluster):
    client = StoreClient.start(num_shards=3)
    made = client.enqueue([Task(task_id=f"t{i}", input={}) for i in range(30)])
    per_shard = [ray.get(s.stats.remote())["rollouts"].get("queued", 0) for s in client.shards]
    assert sum(per_shard) == 30 and all(n > 0 for n in per_shard)
    leased = [client.dequeue() for _ in range(30)]
    assert client.dequeue() is None and sorted(r.rollout_id for r in leased) == sorted(r.rollout_id for r in made)
    client.add_spans([Span(rollout_id=r.rollout_id, attempt_id=r.attempt_id, name="llm.call") for r in leased])
    for r in leased[:5]:  # a rollout's spans live on the rollout's shard
        assert len(ray.get(client.shard(r.rollout_id).query_spans.remote([r.rollout_id]))) == 1
    assert len(client.query_spans()) == 30 and len(client.query_spans(name="llm.call", limit=7)) == 7
    assert len(client.query_spans(name=["reward", "llm.call"])) == 30 and client.query_spans(name=["reward"]) == []
    assert len(client.query_rollouts(status=["running"])) == 30
    ids = [leased[0].rollout_id, "ro-ghost", leased[1].rollout_id]  # on different shards or not: one answer
    assert list(client.cancel(ids).items()) == [(ids[0], "cancelled"), ("ro-ghost", "unknown"), (ids[2], "cancelled")]


def test_a_retried_dequeue_is_answered_by_the_shard_that_leased_it(ray_cluster):
    """Over HTTP the retry goes through the StoreClient again, which starts at the next shard: that one must not
    lease a second rollout under the same attempt id."""
    client = StoreClient.start(num_shards=3)
    client.enqueue([Task(task_id=f"t{i}", input={}) for i in range(30)])
    first = client.dequeue("w", "at-retried")
    assert [client.dequeue("w", "at-retried") for _ in range(3)] == [first] * 3
    assert client.count_rollouts([r.rollout_id for r in client.query_rollouts()]) == {"running": 1, "queued": 29}


def test_both_tracing_paths_store_identical_spans_for_the_same_agent_run(ray_cluster):
    from lightning_ray import tracing
    from lightning_ray.rollout.runner import run_attempt

    def agent(task, **openai_settings):  # no LLM here: the agent's own spans are what is compared
        with tracing.span("plan", {"steps": 2}) as plan:
            plan.add_event("thought", {"text": "use the calculator"})
            tracing.emit_tool("calculator", {"expression": "1+2"}, result="3")
            tracing.emit_tool("calculator", {"expression": "1/0"}, error=ZeroDivisionError("division by zero"))
        tracing.emit_reward({"correct": 1.0, "format": 0.5})
        return "3"

    client = StoreClient.start()
    stored = {}
    for backend in ("embedded", "otel"):
        client.enqueue([Task(task_id="t", input={"question": "1+2"})])
        rollout = client.dequeue("w")
        run_attempt(client, rollout, agent, lambda task, answer: float(answer == "3"), "http://unused", "m",
                    tracing_backend=backend)
        stored[backend] = shape(client.query_spans([rollout.rollout_id]), rollout)
    assert stored["embedded"] == stored["otel"]
    names = [s[0] for s in stored["embedded"]]
    assert names.count("execute_tool calculator") == 2 and names.count("reward") == 2 and "rollout" in names


def shape(spans: list[Span], rollout: Rollout) -> list[tuple]:
    """A span without what differs between runs: ids become positions, times are dropped, stack traces cut."""
    spans = sorted(spans, key=lambda s: (s.name, str(sorted(s.attributes.items()))))
    position = {s.span_id: i for i, s in enumerate(spans)}
    assert {(s.rollout_id, s.attempt_id) for s in spans} == {(rollout.rollout_id, rollout.attempt_id)}
    assert len({s.trace_id for s in spans}) == 1
    return [(s.name, position.get(s.parent_id), s.status, s.status_message, s.attributes,
             [(e.name, {k: v for k, v in e.attributes.items() if k != "exception.stacktrace"}) for e in s.events])
            for s in spans]


def test_the_queue_wal_stays_bounded_over_a_long_run(tmp_path):
    """Tens of thousands of queue operations (dequeue, heartbeats, verdicts), with the checkpoints the store actor
    runs every second in between: the queue's WAL file stays small instead of holding every change of the run."""
    store = SQLiteBackend(tmp_path / "traces.sqlite")
    wal = tmp_path / "traces.sqlite-wal"
    store.enqueue([Rollout(rollout_id=f"r{i}", task=Task(task_id=f"t{i}", input={})) for i in range(2_000)])
    operations, largest = 0, 0
    while (leased := store.dequeue("w", time.time())) is not None:
        _, attempt = leased
        for _ in range(8):
            store.heartbeat(attempt.attempt_id, time.time())
        store.finish_attempt(attempt.attempt_id, "succeeded", time.time(), reward=1.0)
        operations += 10
        if operations % 1_000 == 0:
            store.checkpoint()
            largest = max(largest, wal.stat().st_size)
    assert operations == 20_000
    # ~9 KB per operation: ~9 MiB between two checkpoints here, ~170 MiB by the end without them
    assert largest < 16 << 20, f"the queue's WAL reached {largest / 2**20:.1f} MiB"


@pytest.mark.parametrize("timeout_policy", ["platform", "policy"])
def test_a_stuck_agent_cannot_hold_its_worker(ray_cluster, timeout_policy):
    """An agent that never returns: at the attempt's deadline the worker gives up on it (its thread is left
    behind), the store ends the attempt as a timeout, and the worker goes on to the next rollouts. The platform's
    timeout is retried (no reward); the policy's is scored 0 and stands."""
    from lightning_ray.rollout.runner import work

    client = StoreClient.start(expire_every_s=0.05)
    stuck = threading.Event()
    # The deadline is the stuck rollout's only; 2.5 s leaves its retry room on a loaded machine.
    config = AttemptPolicy(timeout_seconds=2.5, max_attempts=2, timeout_policy=timeout_policy)
    ids = [client.enqueue([Task(task_id="stuck", input={"stuck": True})], config)[0].rollout_id,
           client.enqueue([Task(task_id="fine", input={"stuck": False})])[0].rollout_id]

    def agent(task, **openai_settings):
        if task["stuck"] and not stuck.is_set():  # the first attempt hangs for good; the retry answers
            stuck.set()
            threading.Event().wait()
        return "done"

    ran = []  # no LLM here: the agent never calls the (unreachable) policy URL
    worker = threading.Thread(daemon=True, target=lambda: ran.append(
        work(client, agent, lambda task, answer: 1.0, "http://127.0.0.1:9", "m")))
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "the worker is still waiting on the stuck agent"
    stuck_rollout, fine = client.get_rollouts(ids)
    assert fine.status == "succeeded" and fine.reward == 1.0
    if timeout_policy == "platform":
        assert ran == [3]  # the stuck attempt, its retry, and the other rollout
        assert [a.status for a in client.get_attempts(ids[0])] == ["timeout", "succeeded"]
        assert stuck_rollout.status == "succeeded" and stuck_rollout.reward == 1.0
    else:
        assert ran == [2]  # the stuck attempt, scored, and the other rollout
        assert [a.status for a in client.get_attempts(ids[0])] == ["timeout"]
        assert stuck_rollout.status == "failed" and stuck_rollout.reward == 0.0


@ray.remote(max_concurrency=2)
class SleepyWorker:
    """A rollout worker (two slots) whose agent runs until the rollout its task names has ended (60 s at most)."""

    def work(self, store) -> int:
        from lightning_ray.rollout.runner import work

        def agent(task, **_):
            deadline = time.monotonic() + 60
            while (task.get("until_ended") and time.monotonic() < deadline
                   and store.get_rollouts([task["until_ended"]])[0].status != "succeeded"):
                time.sleep(0.05)
            return "done"

        return work(store, agent, lambda task, answer: 1.0, "http://127.0.0.1:9", "m")

    def worn_out(self) -> bool:  # what run_to_end asks a worker whose slot returned (RolloutWorker.worn_out)
        return False


def test_a_requeued_rollout_is_taken_by_the_next_free_slot(ray_cluster):
    """A rollout whose worker went silent is requeued by the store while another rollout still runs: a slot that
    already found the queue empty takes it at once, not after the slow rollout (when all slots used to be sent
    again)."""
    from lightning_ray.rollout.dispatch import run_to_end

    client = StoreClient.start(expire_every_s=0.05)
    worker = SleepyWorker.remote()
    ray.get(worker.__ray_ready__.remote())  # started: its slots find the queue at once
    [lost] = client.enqueue([Task(task_id="lost", input={})], AttemptPolicy(unresponsive_seconds=1.5, max_attempts=2))
    assert client.dequeue("a worker that dies").rollout_id == lost.rollout_id  # and never heartbeats
    # The slow rollout runs until the lost one has ended (not a guessed duration): taken only after the slow one
    # ended, the lost one would end last.
    [slow] = client.enqueue([Task(task_id="slow", input={"until_ended": lost.rollout_id})],
                            AttemptPolicy(unresponsive_seconds=5))
    ended = run_to_end(client, [worker], 2, [slow.rollout_id, lost.rollout_id], "test")
    by_id = {r.rollout_id: r for r in ended}
    assert [by_id[r.rollout_id].status for r in (slow, lost)] == ["succeeded", "succeeded"]
    assert by_id[lost.rollout_id].ended_at < by_id[slow.rollout_id].ended_at  # a free slot took it meanwhile


@ray.remote(max_concurrency=2, max_restarts=-1)  # as RolloutWorker
class WearingWorker:
    """A rollout worker (two slots) worn out by one abandoned agent (max_abandoned=1); its agent hangs, or sleeps
    `seconds`, as its task says."""

    def work(self, store) -> int:
        from lightning_ray.rollout.runner import work

        def agent(task, **_):
            if task["hang"]:
                threading.Event().wait()
            time.sleep(task["seconds"])
            return "done"

        return work(store, agent, lambda task, answer: 1.0, "http://127.0.0.1:9", "m", max_abandoned=1)

    def worn_out(self) -> bool:
        from lightning_ray.rollout.runner import abandoned_agents

        return abandoned_agents() >= 1


def test_a_worn_out_worker_is_restarted_only_once_no_set_of_rollouts_runs_on_it(ray_cluster):
    """An asynchronous run collects the next batch while the held-out evaluation runs, on the same workers: the set
    whose agent was abandoned must not restart the worker under the other set's rollout (which failed, unrewarded)."""
    from lightning_ray.rollout.dispatch import run_to_end

    client = StoreClient.start(expire_every_s=0.05)
    worker = WearingWorker.remote()
    ray.get(worker.__ray_ready__.remote())
    hangs = [r.rollout_id for r in client.enqueue([Task(task_id="hangs", input={"hang": True, "seconds": 0})],
                                                   AttemptPolicy(timeout_seconds=1.5, max_attempts=1))]
    out = {}
    first = threading.Thread(target=lambda: out.update(first=run_to_end(client, [worker], 2, hangs, "first")))
    first.start()
    time.sleep(0.5)
    evaluated = [r.rollout_id for r in client.enqueue([Task(task_id="slow", input={"hang": False, "seconds": 4})],
                                                       AttemptPolicy(timeout_seconds=60, unresponsive_seconds=3))]
    second = threading.Thread(target=lambda: out.update(second=run_to_end(client, [worker], 2, evaluated, "second")))
    second.start()
    first.join(60)
    second.join(60)
    assert [r.reward for r in out["first"]] == [0.0]  # timed out: the policy's doing
    assert [(r.status, r.reward) for r in out["second"]] == [("succeeded", 1.0)]
    assert not ray.get(worker.worn_out.remote())  # restarted once the second set's rollout had ended
