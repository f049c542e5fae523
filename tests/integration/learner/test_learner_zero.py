"""Every ZeRO stage the config accepts trains, publishes whole weights a server can load, and saves a checkpoint that
loads back: two Ray Train ranks on the tiny model. (Stage 1 below, beside one rank on the same batch; stage 2, the
default for two ranks, in test_train_e2e; stage 0 on one rank in test_learning.) Stage 3 runs PPO: its value head is
partitioned with the policy, its advantages whitened across the ranks, and neither the head nor its optimizer state
may leak into what a server loads."""

from __future__ import annotations

import math
import os
import random
import signal
import threading
import time

import pytest
from helpers import logprob_errors, random_transitions as transitions, small
import ray
import torch
from transformers import AutoModelForCausalLM

from lightning_ray.learner.checkpoint import LoopState, commit, staging
from lightning_ray.learner.driver import Learner
from lightning_ray.learner.digest import parameter_digest
from lightning_ray.learner.worker import clear_stale_build_locks
from lightning_ray.types import Transition
from lightning_ray.weight_sync.registry import WeightRegistry


def uneven_transitions(vocab: int, n: int = 12) -> list[Transition]:
    """Rewards and lengths that differ along the batch, so its halves (the ranks' shares) differ too."""
    rng = random.Random(1)
    return [Transition(rollout_id=f"r{i}", group_id=f"g{i // 4}", span_id=f"s{i}",
                       prompt_ids=[rng.randrange(vocab) for _ in range(20 + i)],
                       response_ids=[rng.randrange(vocab) for _ in range(4 + i % 5)], logprobs=[-1.0] * (4 + i % 5),
                       reward=0.25 * (i % 5), returns=0.25 * (i % 5), policy_version=0, temperature=1.0)
            for i in range(n)]


PPO = {"estimator": "ppo", "kl_coef": 0.1, "kl_penalty": "reward", "tis_cap": 2.0}


def sampled_by(model, batch: list[Transition]) -> list[Transition]:
    """The batch with the logprobs `model` gives its responses, as if it had sampled them."""
    return [Transition.model_validate({**dict(t), "logprobs": logprob_errors(
        model, t.prompt_ids.tolist(), t.response_ids.tolist(), [0.0] * len(t.response_ids)).neg().tolist()})
        for t in batch]


def gap(model, batch: list[Transition]) -> float:
    """The mean |logprob| gap per token between `model` and the batch's sampler."""
    errors = [logprob_errors(model, t.prompt_ids.tolist(), t.response_ids.tolist(), t.logprobs) for t in batch]
    return torch.cat(errors).mean().item()


def assert_whole_weights(replies: list[dict], published: dict, version: int, checkpoint, initial, steps: int = 1):
    """A step on every rank moved the weights alike; what rank 0 published, and the checkpoint's policy, are those
    weights whole (a server loads them strictly, in the model's own shapes)."""
    assert all(r["grad_norm"] > 0 for r in replies)  # reported whatever the stage (DeepSpeed's own only under ZeRO)
    assert {(r["steps"], r["skipped_nonfinite"]) for r in replies} == {(steps, 0)}
    [digest] = {r["digest"] for r in replies}  # every rank holds the same weights ...
    assert digest != parameter_digest(initial)  # ... moved by the step
    served = AutoModelForCausalLM.from_pretrained(initial.name_or_path)
    served.load_state_dict(published)
    assert version == 1 and parameter_digest(served) == digest
    assert parameter_digest(AutoModelForCausalLM.from_pretrained(checkpoint / "policy")) == digest


def test_zero3_publishes_whole_weights_and_a_resumed_or_restarted_learner_takes_the_step_the_saved_one_would(
        ray_cluster, tiny_model_path, tmp_path):
    """ZeRO-3 PPO on two ranks: a step (the critic trained with the policy, whole weights published and saved, as for
    the other stages above), a checkpoint, a second step; a learner resumed from the checkpoint takes the second step
    to the same weights. Only with AdamW's moments and the value head restored (from each rank's partitions): fresh
    moments or a fresh head would step elsewhere. Then the same step again, and one of its ranks is SIGKILLed in the
    middle of it: Ray Train restarts both ranks, they load the checkpoint, rank 0 publishes the checkpoint's weights as
    the next version (the replicas served the lost update, from a payload the dead rank 0 owned), then the step is
    taken again, to the same weights, and published as the version after."""
    def config(run_dir):  # a run's learner queues are named after its directory
        return small({"run_dir": str(run_dir), "algorithm": PPO, "learner": {
            "num_workers": 2, "threads_per_worker": 1, "zero_stage": 3, "lr": 1e-3, "micro_batch_tokens": 96,
            "max_logprob_gap": None}})

    cfg = config(tmp_path / "run")
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    first, second = transitions(initial.config.vocab_size), uneven_transitions(initial.config.vocab_size)
    registry = WeightRegistry.remote()
    learner = Learner(cfg, tiny_model_path, registry)
    try:
        replies = learner.step(first)
        version, refs = ray.get(registry.wait_newer.remote(0, 10.0))
        published = ray.get(refs[0])
        staged = staging(tmp_path / "run", 1)
        learner.save(staged)
        saved = commit(staged, LoopState(next_iteration=1, policy_version=learner.version, rng_state=[], evals=[],
                                         started=[], history=[]), keep=1)
        [expected] = {r["digest"] for r in learner.step(second)}
    finally:
        learner.close()
    assert_whole_weights(replies, published, version, saved.path, initial)
    # the critic trained (V = 0 at first, returns 0 and 1) and left out of what a server loads (strict load above)
    assert sum(r["value_loss"] for r in replies) > 0 and all(r["kl_ref"] < 1e-6 for r in replies)
    registry = WeightRegistry.remote(saved.state.policy_version)
    resumed = Learner(config(tmp_path / "resumed"), tiny_model_path, registry, resume_from=saved)
    try:
        replies = resumed.step(second)
        assert resumed.version == 2 and {r["digest"] for r in replies} == {expected}
        os.kill(resumed.ranks[1]["pid"], signal.SIGSTOP)  # before the step is sent: it cannot finish without rank 1
        republished = {}
        killer = threading.Thread(target=kill_once_taken, args=(resumed, 1, registry, republished))
        killer.start()
        replies = resumed.step(second)
        killer.join()
    finally:
        resumed.close()
    assert resumed.restarts == 1 and resumed.version == 4 and {r["digest"] for r in replies} == {expected}
    assert ray.get(registry.wait_newer.remote(3, 1.0))[0] == 4
    # version 3: the checkpoint's weights, from the new rank 0 (version 2's payload died with the old one)
    assert republished["version"] == 3
    reloaded = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    reloaded.load_state_dict(republished["state"])
    assert parameter_digest(reloaded) == parameter_digest(AutoModelForCausalLM.from_pretrained(saved.path / "policy"))


def kill_once_taken(learner: Learner, rank: int, registry, republished: dict) -> None:
    """SIGKILLs the (stopped) rank's process once the other ranks have taken their step (their inboxes empty): they
    wait for it in the step's first collective, so the learner dies mid-step, the stopped rank's message still queued
    for it. Then fetches into `republished` the next version the registry holds (the restarted ranks')."""
    while not all(inbox.empty() for i, inbox in enumerate(learner.inboxes) if i != rank):
        time.sleep(0.01)
    version = ray.get(registry.wait_newer.remote(0, 0.0))[0]
    os.kill(learner.ranks[rank]["pid"], signal.SIGKILL)
    republished["version"], payload = ray.get(registry.wait_newer.remote(version, 120.0))
    republished["state"] = ray.get(payload[0])


def test_a_rank_killed_between_commands_is_restarted_and_republishes_before_the_next_one(ray_cluster,
                                                                                          tiny_model_path, tmp_path):
    """A learner rank SIGKILLed while no command is in flight (the rollouts running): its restart is attached and
    rank 0 publishes the weights it went back to (the initial policy: no checkpoint was saved) without waiting for a
    command, so a replica that starts meanwhile finds a version it can fetch (the one before died with the old rank
    0), and the rollouts, which the next command waits for, are not left waiting for it. The next step goes on,
    on a batch sampled by the lost version's weights: learner.max_logprob_gap, checked at the run's first step
    against the weights that sampled it, is not checked there (the gap is the update the rank went back from)."""
    cfg = small({"run_dir": str(tmp_path), "learner": {"num_workers": 1, "threads_per_worker": 1, "lr": 1e-2,
                                                       "micro_batch_tokens": 96, "max_logprob_gap": 0.02}})
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    registry = WeightRegistry.remote()
    learner = Learner(cfg, tiny_model_path, registry)
    try:
        learner.step(sampled_by(initial, transitions(initial.config.vocab_size)))
        version, payload = ray.get(registry.wait_newer.remote(0, 10.0))
        updated = AutoModelForCausalLM.from_pretrained(tiny_model_path)
        updated.load_state_dict(ray.get(payload[0]))
        second = sampled_by(updated, transitions(initial.config.vocab_size))
        assert gap(initial, second) > 0.02  # what the restarted rank's weights make of it
        os.kill(learner.ranks[0]["pid"], signal.SIGKILL)
        republished, fresh = ray.get(registry.wait_newer.remote(version, 120.0))  # no command sent meanwhile
        state = ray.get(fresh[0])
        with pytest.raises(ray.exceptions.ObjectLostError):
            ray.get(payload[0], timeout=30)
        [reply] = learner.step(second)
    finally:
        learner.close()
    assert (version, republished, learner.restarts, learner.version) == (1, 2, 1, 3)
    # staleness in updates: 2 repeats the initial weights (0), 1's were given up, 3 is one update past 0 and 2
    assert [learner.behind(v) for v in range(4)] == [1, None, 1, 0]
    reloaded = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    reloaded.load_state_dict(state)
    assert parameter_digest(reloaded) == parameter_digest(initial) != reply["digest"]


def test_two_ranks_train_like_one(ray_cluster, tiny_model_path, tmp_path):
    """The same PPO batch on one rank and on two (ZeRO-1: each rank half the batch in its own micro-batches, and half
    the optimizer state), in 4 optimizer steps (2 mini-batches × 2 epochs), every rank in each of them: the loss is
    scaled by the world size where DeepSpeed averages the ranks' gradients, and the advantages are whitened over the
    whole batch, not per rank, so the two runs see the same losses and gradients, and publish the same weights; the
    two ranks' weights are whole where they are published and saved, as for the other stages."""
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    vocab = initial.config.vocab_size
    runs = []
    for ranks in (1, 2):
        cfg = small({"run_dir": str(tmp_path / str(ranks)), "algorithm": {**PPO, "ppo_epochs": 2, "mini_batches": 2},
                     "learner": {"num_workers": ranks, "threads_per_worker": 1, "zero_stage": 1, "lr": 1e-3,
                                 "micro_batch_tokens": 96, "max_logprob_gap": None}})  # made-up served logprobs
        registry = WeightRegistry.remote()
        learner = Learner(cfg, tiny_model_path, registry)
        try:
            replies = learner.step(uneven_transitions(vocab))
            version, refs = ray.get(registry.wait_newer.remote(0, 10.0))
            published = ray.get(refs[0])
            if ranks == 2:
                learner.save(tmp_path / "checkpoint")
        finally:
            learner.close()
        runs.append({"loss": sum(r["loss"] for r in replies), "value_loss": sum(r["value_loss"] for r in replies),
                     "grad_norm": replies[0]["grad_norm"], "weights": published, "replies": replies,
                     "version": version})
    one, two = runs
    assert_whole_weights(two["replies"], two["weights"], two["version"], tmp_path / "checkpoint", initial, steps=4)
    for key in ("loss", "value_loss", "grad_norm"):
        assert two[key] == pytest.approx(one[key], rel=1e-6), key  # equal to the bit here; a bug moves ~1e-4
    assert max((one["weights"][k] - two["weights"][k]).abs().max().item() for k in one["weights"]) < 1e-5


def test_a_build_lock_left_by_a_killed_build_is_cleared_and_a_live_one_kept(tmp_path):
    # torch waits on an op-build lock for as long as it exists: one left by a killed build hung every later learner
    stale, live = tmp_path / "cpu_adam" / "lock", tmp_path / "other_op" / "lock"
    for lock in (stale, live):
        lock.parent.mkdir()
        lock.touch()
    an_hour_ago = time.time() - 3600
    os.utime(stale, (an_hour_ago, an_hour_ago))
    assert clear_stale_build_locks(str(tmp_path)) == [stale]
    assert not stale.exists() and live.exists()


def test_the_gpu_learner_settings_train_on_cpu_too(ray_cluster, tiny_model_path, tmp_path):
    """What a GPU gets by default — bf16 with fp32 master weights (ZeRO-1 on one rank: DeepSpeed's bf16 optimizer)
    and activation checkpointing — runs the same code on CPUs: the step moves the weights, and what is published is
    the bf16 policy, whole, and the checkpoint is it. A batch whose loss is not finite then changes nothing: its step
    is skipped (DeepSpeed's bf16 optimizer finds the gradient not finite), and no version is published. A batch the
    rank raises on (a token outside the vocabulary) fails the step at once with the rank's error, not retried. The
    rank's process runs in learner.env's environment (placement=cpu sets glibc's allocator there)."""
    cfg = small({"run_dir": str(tmp_path), "learner": {
        "num_workers": 1, "threads_per_worker": 1, "dtype": "bfloat16", "gradient_checkpointing": True, "lr": 1e-2,
        "micro_batch_tokens": 96, "max_logprob_gap": None, "env": {"LIGHTNING_RAY_RANK_ENV": "set"}}})
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    registry = WeightRegistry.remote()
    learner = Learner(cfg, tiny_model_path, registry)
    try:
        [reply] = learner.step(transitions(initial.config.vocab_size))
        environ = open(f"/proc/{learner.ranks[0]['pid']}/environ", "rb").read().split(b"\0")
        version, payload = ray.get(registry.wait_newer.remote(0, 10.0))
        published = ray.get(payload[0])
        [skipped] = learner.step([t.model_copy(update={"advantage": math.nan})
                                  for t in transitions(initial.config.vocab_size)])
        learner.save(tmp_path / "checkpoint")
        vocab = initial.config.vocab_size
        with pytest.raises(RuntimeError, match=r"learner rank 0 failed:(.|\n)*IndexError"):
            learner.step([t.model_copy(update={"prompt_ids": [vocab + 7, *t.prompt_ids[1:]]})
                          for t in transitions(vocab)])
    finally:
        learner.close()
    assert learner.restarts == 0 and b"LIGHTNING_RAY_RANK_ENV=set" in environ
    assert not skipped["updated"] and skipped["skipped_nonfinite"] == skipped["steps"] == 1
    assert skipped["digest"] == reply["digest"] and learner.version == 1
    assert ray.get(registry.wait_newer.remote(0, 1.0))[0] == 1
    assert reply["grad_norm"] > 0 and reply["digest"] != parameter_digest(initial)
    assert {t.dtype for t in published.values()} == {torch.bfloat16}
    served = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16)
    served.load_state_dict(published)
    assert version == 1 and parameter_digest(served) == reply["digest"]
    assert parameter_digest(AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint" / "policy")) == reply["digest"]
