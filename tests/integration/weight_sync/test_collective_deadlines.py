"""The collective transport's deadlines (lightning_ray/weight_sync/collective.py), on gloo between a real publisher
and real receivers through the real registry: a group whose peer never joins fails the transfer on both sides
within serve.sync_timeout_s and leaves the learner free for its next publish; replicas queued behind each other
each get the whole timeout for their own transfer. The receivers load into an engine that keeps what it gets (the
HF engine's load is test_weight_transports.py's)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from contextlib import asynccontextmanager

import pytest
import ray
import torch

from lightning_ray.weight_sync import collective
from lightning_ray.weight_sync.collective import CollectivePublisher, CollectiveReceiver
from lightning_ray.weight_sync.registry import WeightRegistry

TIMEOUT_S = 4.0  # each transfer in the queued test takes 0.6 of it: 1.6 s of slack for a loaded 2-core machine


class Engine:
    def __init__(self):
        self.loaded: dict[int, dict[str, torch.Tensor]] = {}

    def check_layout(self, layout) -> None:
        pass

    async def copy_weights(self, tensors, version: int) -> None:
        self.loaded[version] = {name: t.clone() for name, t in tensors}


@asynccontextmanager
async def serving_goes_on():
    yield


@pytest.fixture
def registry(ray_cluster):
    registry = WeightRegistry.remote()
    yield registry
    ray.kill(registry)


@pytest.fixture
def model():
    return torch.nn.Linear(4, 3)  # two buckets of 48 and 12 bytes (bucket_bytes=48): a transfer has a middle


def publisher(registry) -> CollectivePublisher:
    return CollectivePublisher(registry, torch.device("cpu"), TIMEOUT_S, bucket_bytes=48)


def sent(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.timeout(60)
def test_a_group_whose_peer_never_joins_fails_in_time_and_frees_the_learner(registry, model, monkeypatch, caplog):
    """Building a group never completes on either side: it stands for NCCL's init (ncclCommInitRank, torch's first
    collective), which waits for ever for a peer that passed the TCPStore rendezvous but never joins; gloo's own
    rendezvous times out, so the patch is what makes it hang here."""
    never = threading.Event()

    def hang(self, *args):
        never.wait()
        raise ConnectionError("the test ended")

    monkeypatch.setattr(collective._TorchGroup, "__init__", hang)
    learner, replica, engine = publisher(registry), CollectiveReceiver(registry, "replica-a", TIMEOUT_S), Engine()

    def publish_returns(version: int, within_s: float) -> bool:
        done = threading.Thread(target=learner.publish, args=(version, model), daemon=True)
        done.start()
        done.join(within_s)
        return not done.is_alive()

    async def receive(offer, version: int) -> bool:
        return await replica.receive(offer, version, engine, serving_goes_on)

    async def peer_never_joins():
        try:
            start = time.monotonic()
            with pytest.raises(TimeoutError, match="weight sync: no transfer group with the learner"):
                await asyncio.wait_for(receive(learner.publish(1, model), 1), TIMEOUT_S + 3)
            assert publish_returns(2, within_s=3)  # the sender let go of the buckets
            assert time.monotonic() - start < TIMEOUT_S + 3
        finally:
            never.set()  # the abandoned builders end

    try:
        with caplog.at_level(logging.ERROR, logger=collective.__name__):
            asyncio.run(peer_never_joins())
        failure = next(r for r in caplog.records if r.exc_info)
        assert "replica-a" in failure.getMessage() and "weight sync" in str(failure.exc_info[1]), caplog.text
        assert replica.group is None and "replica-a" not in learner.groups

        monkeypatch.undo()  # the peer joins: a new group, not the abandoned one, and the learner serves it
        offer = learner.publish(3, model)
        assert asyncio.run(receive(offer, 3))
        assert all(torch.equal(engine.loaded[3][n], t) for n, t in sent(model).items())
    finally:
        learner.close()


@pytest.mark.timeout(60)
def test_replicas_queued_behind_each_other_each_get_the_whole_timeout(registry, model):
    """Three replicas ask at once; each transfer takes 0.6 timeout_s (the sender pauses after the first bucket, so
    the replica waits for the second within its own deadline). The third is taken 1.2 timeout_s after it asked, and
    the trainer's barrier, waiting for all three with the same timeout, sees one more catch up within each."""
    learner = publisher(registry)
    learner._sent = lambda bucket: time.sleep(0.6 * TIMEOUT_S) if bucket == 0 else None
    replicas = {f"replica-{i}": (CollectiveReceiver(registry, f"replica-{i}", TIMEOUT_S), Engine()) for i in range(3)}
    ray.get([registry.ack.remote(name, 0) for name in replicas])  # serving version 0
    try:
        offer = learner.publish(1, model)

        async def receive_and_ack(name, replica, engine) -> bool:
            loaded = await replica.receive(offer, 1, engine, serving_goes_on)
            await registry.ack.remote(name, 1)
            return loaded

        async def all_receive():
            return await asyncio.gather(*(receive_and_ack(name, *pair) for name, pair in replicas.items()))

        start = time.monotonic()
        synced = registry.wait_synced.remote(1, TIMEOUT_S)
        assert asyncio.run(all_receive()) == [True, True, True]
        assert time.monotonic() - start >= 3 * 0.6 * TIMEOUT_S  # one after another
        ray.get(synced, timeout=TIMEOUT_S)  # the barrier saw them all, though it took longer than its timeout
        for _, engine in replicas.values():
            assert all(torch.equal(engine.loaded[1][n], t) for n, t in sent(model).items())
    finally:
        learner.close()
