"""Update the policy: the learner's step on the batch, the new weights synced to every serve replica (checked
through the API with a fixed probe), and the checkpoint a resumed run goes on from."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import ray
from openai import APIError, OpenAI

from lightning_ray.algorithm.advantages import has_signal
from lightning_ray.config import AlgorithmConfig, TrainConfig
from lightning_ray.learner import checkpoint
from lightning_ray.metrics import count_error, metrics
from lightning_ray.terminal import status
from lightning_ray.trainer.collect import Batch
from lightning_ray.trainer.run import Run
from lightning_ray.types import Transition

PROBE = [{"role": "user", "content": "What is 3 + 4?"}]  # a fixed prompt whose served logprobs track each update


@dataclass
class Update:
    results: list[dict] = field(default_factory=list)  # each learner rank's reply; none when nothing was trained
    probe_before: dict | None = None  # the probe's version and logprobs, served before and after the sync
    probe_after: dict | None = None
    staleness: Counter = field(default_factory=Counter)  # transitions by updates their sampler is behind the learner
    stale_dropped: int = 0  # transitions left out: sampled more than algorithm.max_staleness updates behind, or lost


def update(run: Run, batch: Batch) -> Update:
    """No step when no group has a learning signal: the policy stays as it is, no new version. Transitions sampled
    more than `algorithm.max_staleness` updates behind the learner are left out (rollout.mode=async), and those
    sampled by weights a restart gave up (learner/lineage.py)."""
    cfg, learner, services = run.cfg, run.learner, run.services
    behind = [learner.behind(tr.policy_version) for tr in batch.transitions]  # in updates; None: lost in a restart
    staleness = Counter(b for b in behind if b is not None)
    chosen, stale_dropped = to_train(batch.transitions, behind, cfg.algorithm)
    if not chosen:
        return Update(staleness=staleness, stale_dropped=stale_dropped)
    metrics().staleness.set(max(behind[i] for i in chosen))  # updates the learner is ahead of the oldest trained
    trained = [batch.transitions[i] for i in chosen]
    probe_before = run.probe or probe(services.server_url, cfg)
    with run.phase("train"), status(f"iter {batch.iteration}: training on {len(trained)} transitions",
                                    report=False):
        if cfg.engine.sleep_while_training:  # the GPU they share is the learner's till the sync
            services.sleep_engines()
        results = learner.step(trained)
        if cfg.engine.sleep_while_training and not results[0]["updated"]:  # each step skipped: no version wakes them
            services.wake_engines()
    with run.phase("sync"), status(f"iter {batch.iteration}: syncing weights", report=False):
        ray.get(services.registry.wait_synced.remote(learner.version, cfg.serve.sync_timeout_s))
    metrics().weight_sync_seconds.observe(run.phase.seconds["sync"])
    run.probe = probe(services.server_url, cfg)
    return Update(results, probe_before, run.probe, staleness, stale_dropped)


def to_train(transitions: list[Transition], behind: list[int | None], alg: AlgorithmConfig) -> tuple[list[int], int]:
    """Which of the batch's transitions the learner trains on (their indices; none when none has a signal), and how
    many were left out as stale: sampled more than algorithm.max_staleness updates behind (`behind`), or by weights
    a restart gave up (None). With dynamic sampling its dropped groups are out too: with a KL or entropy term the
    learner would train them (and dilute the loss's token mean with them)."""
    fresh = [i for i, b in enumerate(behind) if b is not None and b <= alg.max_staleness]
    signal = {transitions[i].group_id for i in fresh if has_signal(transitions[i], alg.estimator)}
    trained = [i for i in fresh if transitions[i].group_id in signal] if alg.dynamic_sampling else fresh
    # every transition with a signal may be among the stale ones: the learner would refuse the rest
    return trained if signal else [], len(transitions) - len(fresh)


def save_checkpoint(run: Run, iteration: int) -> None:
    """After the iteration's record: the checkpoint holds it."""
    # the learner's lock: ranks restarted meanwhile are attached to this checkpoint, not the one before
    with run.phase("checkpoint"), status(f"iter {iteration}: checkpoint", report=False), run.learner.lock:
        staged = checkpoint.staging(run.cfg.run_path, iteration + 1)
        run.learner.save(staged)
        # the run's latest: what restarted learner ranks go on from
        run.learner.checkpoint = checkpoint.commit(staged, run.state(iteration), run.cfg.trainer.keep_checkpoints)


def probe(server_url: str, cfg: TrainConfig) -> dict | None:
    """Greedy-decode a fixed prompt through the real API: its logprobs move when the served weights do. None when the
    API did not answer it, retries included (the replica lost meanwhile: the soak's faults): a measurement, the run
    goes on without it."""
    client = OpenAI(base_url=f"{server_url}/v1", api_key=cfg.serve.api_key or "EMPTY", max_retries=2)
    # an adapter per agent: the first adapter's policy (the base, which a call naming none gets, never moves)
    model = f"{cfg.model.name}/{next(iter(cfg.algorithm.adapters))}" if cfg.algorithm.adapters else cfg.model.name
    try:
        out = client.chat.completions.create(model=model, messages=PROBE, temperature=0, max_tokens=8, logprobs=True)
    except APIError as e:
        count_error("trainer", "probe_failed")
        print(f"the served policy's probe failed ({type(e).__name__}: {e}); going on without it", flush=True)
        return None
    lps = [c.logprob for c in out.choices[0].logprobs.content]
    return {"version": int(out.system_fingerprint.rsplit("v", 1)[1]), "logprob_mean": sum(lps) / max(len(lps), 1)}
