"""The learner, as the trainer sees it: one TorchTrainer.fit() in a thread (the ranks: learner/worker.py), fed
batches through mailboxes (learner/mailboxes.py).

A rank whose process dies (its node lost, killed, out of host memory) is restarted by Ray Train with every other rank
(learner.max_restarts, Ray Train's FailureConfig); the new ranks load the run's latest checkpoint and take the
command that was in flight again, and the run goes on. Updates since that checkpoint are lost (none with
trainer.checkpoint_every=1): rank 0 publishes the weights the ranks went back to as the next version, so the replicas
serve what the learner holds; the versions only go up. Ranks restarted between commands (while the rollouts run) are
attached as soon as they start, not at the next command: the current version's payload died with the old rank 0, a
replica started meanwhile (its node lost too) waits for the new one, and the rollouts may wait for that replica."""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from pathlib import Path

import numpy as np
import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.callbacks import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

from lightning_ray.algorithm.advantages import has_signal
from lightning_ray.algorithm.loss import token_weights
from lightning_ray.algorithm.select import by_adapter
from lightning_ray.config import AlgorithmConfig, LearnerConfig, TrainConfig
from lightning_ray.learner.checkpoint import Checkpoint
from lightning_ray.learner.lineage import Lineage
from lightning_ray.learner.mailboxes import Mailbox, Mailboxes
from lightning_ray.learner.scoring import MicroBatch, shared_prefix
from lightning_ray.learner.worker import train_loop_per_worker
from lightning_ray.metrics import count_error
from lightning_ray.placement import ON_HEAD, share_a_gpu
from lightning_ray.types import Transition
from lightning_ray import weight_sync


class Learner:
    WATCH_S = 2.0  # how often, between commands, the ranks' outbox is looked at for restarted ranks

    def __init__(self, cfg: TrainConfig, model_path: Path, registry, resume_from: Checkpoint | None = None):
        """`model_path`: the initial policy; `resume_from`: the checkpoint whose learner state the ranks load."""
        t = cfg.learner
        self.n, self.timeout_s, self.token_budget = t.num_workers, t.step_timeout_s, t.micro_batch_tokens
        self.share_prefix = resolved(t).shared_prefix
        self.algorithm, self.max_tokens = cfg.algorithm, cfg.rollout.max_tokens
        self.version = resume_from.state.policy_version if resume_from else 0
        self.lineage = Lineage()  # which versions were updates: a restart publishes a checkpoint's weights again
        self.checkpoint = resume_from  # what a (re)started rank loads: the run's latest (set as each one is made)
        self.registry, self.restarts, self.max_restarts = registry, 0, t.max_restarts
        self.ranks: dict[int, dict] = {}  # rank -> the ready message of its process now attached (nonce, pid, actor)
        self.replaced: set[str] = set()  # the nonces of processes restarted ranks replaced
        # Beside the driver, whose messages they carry: on a cluster, not on whichever node had room for them.
        self.mailboxes = Mailboxes.options(name=f"learner-mailboxes@{cfg.run_path.name}", **ON_HEAD).remote(self.n + 1)
        self.inboxes = [Mailbox(self.mailboxes, i) for i in range(self.n)]
        self.outbox = Mailbox(self.mailboxes, self.n)
        # Ray Train's preemption watcher only logs node drains and offers them to a training function that asks
        # (ray.train.get_preemption_info; ours does not: a lost rank restarts from the checkpoint): an actor and a
        # poll per start for nothing. Set the variable to 1 to have it.
        os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")  # passed on to Ray Train's controller
        trainer = LeanTorchTrainer(
            train_loop_per_worker,
            train_loop_config={
                "model_path": str(model_path), "inboxes": self.inboxes, "outbox": self.outbox, "registry": registry,
                "weight_sync": {"kind": weight_sync.of_run(cfg),
                                "timeout_s": cfg.serve.sync_timeout_s},
                "engine_wakes_beside": engine_wakes_beside(cfg),
                "learner": resolved(t), "algorithm": cfg.algorithm,
                "extensions_dir": str(Path("~/.cache/lightning_ray/torch_extensions").expanduser()),
            },
            # learner.resources_per_worker is one logical CPU by default, whatever the threads: phases alternate, so
            # the learner's threads use the cores the rollouts leave idle while it trains. Ray Train reserves the
            # workers' resources as one placement group, spread over nodes by learner.placement_strategy.
            scaling_config=ScalingConfig(num_workers=self.n, use_gpu=on_gpus(t),
                                         resources_per_worker=t.resources_per_worker,
                                         placement_strategy=t.placement_strategy),
            run_config=RunConfig(name="learner", storage_path=str(cfg.run_path / "ray_train"),
                                 failure_config=FailureConfig(max_failures=t.max_restarts),
                                 worker_runtime_env={"env_vars": t.env} if t.env else None),
        )
        self.error: BaseException | None = None
        self.stopping = False
        # One conversation with the ranks at a time: a command's, or the watcher's attaching ranks restarted between
        # commands (held by whoever reads the version too, so a republish cannot slip in between).
        self.lock = threading.RLock()
        self.watch_error: BaseException | None = None  # the watcher's, raised by the next command
        self.thread = threading.Thread(target=self._fit, args=(trainer,), daemon=True, name="learner-fit")
        self.thread.start()  # returns at once: the ranks start while the caller starts other things (services.py)
        threading.Thread(target=self._watch, daemon=True, name="learner-watch").start()

    def wait_ready(self) -> None:
        """Until every rank has built its DeepSpeed engine and loaded the checkpoint it goes on from, if any (the
        first step or save waits for it too)."""
        self._command(None)

    def _fit(self, trainer: TorchTrainer) -> None:
        try:
            trainer.fit()
        except BaseException as e:  # surfaced to the driver by _next
            self.error = e

    def _watch(self) -> None:
        """Between commands, attaches the ranks Ray Train restarted (their start message the one thing the outbox
        can then hold, but for a replaced process's late reply), so rank 0 republishes within seconds. A replica
        that starts meanwhile cannot fetch the version whose payload the dead rank 0 owned, and the next command
        waits for the iteration's rollouts, which may wait for that replica (the soak of 2026-12-04)."""
        while not self.stopping:
            time.sleep(self.WATCH_S)
            with self.lock:
                try:
                    if self.stopping or not self.ranks or self.outbox.empty():
                        continue
                    if (msg := self._next()).get("ready"):
                        self._command(None, restarted={msg["rank"]: msg})
                except BaseException as e:  # the next command raises it
                    if not self.stopping:
                        self.watch_error = e
                    return

    def _next(self) -> dict:
        """The next message from a rank; fails fast if the training run died or a rank failed."""
        waited = 0.0
        while True:
            try:
                msg = self.outbox.get(timeout=1.0)
            except queue.Empty:
                waited += 1.0
                if not self.thread.is_alive():
                    raise RuntimeError("the training run stopped") from self.error
                if waited > self.timeout_s:
                    raise TimeoutError(
                        f"no reply from the training workers in learner.step_timeout_s={self.timeout_s}s")
                continue
            if "error" not in msg:
                return msg
            if msg["nonce"] not in self.replaced and not self._peer_died(msg["rank"]):
                raise RuntimeError(f"learner rank {msg['rank']} failed:\n{msg['error']}")
            # a replaced process's, or its collective broke because another rank died: Ray Train restarts them all

    def _peer_died(self, rank: int) -> bool:
        """Whether a rank other than `rank` is dead (or does not answer within 10 s)."""
        for other, msg in self.ranks.items():
            if other != rank:
                try:
                    ray.get(msg["actor"].__ray_ready__.remote(), timeout=10)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    return True
        return False

    def _attach(self, ready: dict[int, dict], publish: int | None = None) -> None:
        """Waits for every rank's process to start (`ready`: those already heard from), then tells each the checkpoint
        to load, if any, and waits for them all to have loaded it (and rank 0 to have published what they loaded as
        version `publish`, if given)."""
        while len(ready) < self.n:
            if (msg := self._next()).get("ready"):
                ready[msg["rank"]] = msg
        self.replaced |= {msg["nonce"] for msg in self.ranks.values()}
        self.ranks = ready
        load = str(self.checkpoint.path) if self.checkpoint else None
        for rank, msg in ready.items():
            self.inboxes[rank].put({"kind": "attach", "nonce": msg["nonce"], "load": load, "publish": publish})
        self._gather()

    def _command(self, messages: list[dict] | None, restarted: dict[int, dict] | None = None) -> list[dict]:
        """Each rank its message (None: none, only attach the ranks); their replies, in rank order. Ranks restarted
        meanwhile (`restarted`: the new processes heard from) are attached to the latest checkpoint and get the
        message again."""
        with self.lock:
            if self.watch_error is not None:
                raise self.watch_error
            if restarted is not None:
                self._count_restart()
            while True:
                try:
                    if not self.ranks:
                        self._attach({})
                    if restarted is not None:
                        # The replicas serve the updates the restart lost, from a payload the dead rank 0 owned:
                        # a replica started now could not fetch it. Rank 0 publishes the weights the ranks went back
                        # to as the next version (versions only go up; rank 0 may have published the step in flight
                        # before it died), unless nothing was published yet.
                        published, payload = ray.get(self.registry.wait_newer.remote(0, 0.0))
                        self._attach(restarted, publish=published + 1 if payload is not None else None)
                        if payload is not None:
                            kept = self.checkpoint.state.policy_version if self.checkpoint else 0
                            self.lineage.republished(published + 1, kept, published)
                            self.version = published = published + 1
                        if messages and messages[0]["kind"] == "step":
                            messages = [{**msg, "version": max(msg["version"], published + 1)} for msg in messages]
                        restarted = None
                    if messages is None:
                        return []
                    for inbox, msg in zip(self.inboxes, messages):
                        inbox.put(msg)
                    return self._gather()
                except _Restarted as restart:
                    restarted = restart.ready
                    self._count_restart()

    def _count_restart(self) -> None:
        self.restarts += 1
        count_error("learner", "ranks_restarted")  # the dashboard's errors panel
        since = f"{self.checkpoint.path.name} (policy v{self.checkpoint.state.policy_version})" \
            if self.checkpoint else "the initial policy"
        print(f"the learner's ranks were restarted ({self.restarts} of learner.max_restarts={self.max_restarts}): "
              f"going on from {since}; the updates after it are lost", flush=True)

    def _gather(self) -> list[dict]:
        """One reply per rank from its attached process, in rank order. Replies from a process since replaced are
        dropped; a new process's start means the ranks restarted (_Restarted)."""
        replies: dict[int, dict] = {}
        while len(replies) < self.n:
            msg = self._next()
            if msg.get("ready"):
                raise _Restarted(msg)
            if msg["nonce"] == self.ranks[msg["rank"]]["nonce"]:
                replies[msg["rank"]] = msg
        return [replies[rank] for rank in range(self.n)]

    def step(self, transitions: list[Transition]) -> list[dict]:
        """The optimizer steps over the batch (batch_plan), publishing policy version v+1, unless every step was
        skipped (a gradient not finite: replies' `updated` false), which leaves the weights and the version as they
        were. The caller skips batches without any signal: an empty step would still move the weights (Adam's
        momentum) and bump the version for nothing."""
        plan = batch_plan(transitions, self.algorithm, self.max_tokens, self.token_budget, self.n, self.share_prefix)
        with self.lock:  # the version as the watcher may have moved it
            replies = self._command([{"kind": "step", "version": self.version + 1, "mini_batches": mini_batches,
                                      "adapters": micro_batch_adapters(plan)} for mini_batches in plan])
            if replies[0]["updated"]:  # else every rank skipped the same steps
                self.version = replies[0]["version"]
        return replies

    def behind(self, version: int) -> int | None:
        """How many updates the learner's weights are past policy `version`'s (None: that version's were lost in a
        restart): a sample's staleness."""
        with self.lock:  # the version as the watcher may have moved it
            return self.lineage.behind(version, self.version)

    def save(self, path: Path) -> None:
        """The policy (HF) into path/policy, the learner's whole state into path/learner (learner/checkpoint.py)."""
        self._command([{"kind": "save", "path": str(path)}] * self.n)

    def stop(self) -> None:
        """Tells each rank to stop, without waiting for the training run to end (close does). A queue already gone
        (its node lost) is no reason to fail: stopping runs on the way out of a run, and whatever ended it is the
        error to see."""
        if not self.stopping:
            self.stopping = True
            for inbox in self.inboxes:
                with contextlib.suppress(ray.exceptions.RayError):
                    inbox.put(None)

    def close(self, timeout: float = 60) -> None:
        """Stops the ranks and waits for the training run to end (`timeout` seconds at most)."""
        self.stop()
        self.thread.join(timeout=timeout)
        ray.kill(self.mailboxes)  # named: in a driver that goes on (the tests' one cluster) it would outlive the run


class LeanTorchTrainer(TorchTrainer):
    """Ray Train's TorchTrainer less two actors each start would add for nothing here (~2 CPU-s each on 2 cores): the
    dataset manager (no Ray Datasets are passed) and the placement-group cleaner (for a controller that dies while its
    driver lives on, which ends this run, and the job's placement groups with it). Ray Train's own callbacks, hence
    private imports: `ray` is pinned (constraints.txt) and the learner's tests would fail on a rename."""

    def _create_default_callbacks(self) -> list:
        return [c for c in super()._create_default_callbacks()
                if not isinstance(c, (DatasetsCallback, PlacementGroupCleanerCallback))]


def resolved(t: LearnerConfig) -> LearnerConfig:
    """The learner's settings as its ranks use them: `auto` dtype, attention, ZeRO stage and gradient checkpointing
    decided for this run, and prefix sharing off under gradient checkpointing (transformers drops a layer's cache
    there)."""
    checkpointing = t.gradient_checkpointing is True or (t.gradient_checkpointing == "auto" and on_gpus(t))
    dtype = learner_dtype(t)
    attention = t.attn_implementation
    if attention == "auto":
        attention = "eager" if dtype == "bfloat16" and not on_gpus(t) else "sdpa"
    return t.model_copy(update={"dtype": dtype, "zero_stage": zero_stage(t), "attn_implementation": attention,
                                "gradient_checkpointing": checkpointing,
                                "shared_prefix": t.shared_prefix and not checkpointing})


def learner_dtype(t: LearnerConfig) -> str:
    """learner.dtype, `auto` resolved: bfloat16 when the ranks get GPUs, float32 on CPUs."""
    if t.dtype != "auto":
        return t.dtype
    return "bfloat16" if on_gpus(t) else "float32"


def on_gpus(t: LearnerConfig) -> bool:
    """Whether the ranks get GPUs (learner.resources_per_worker): what every `auto` of the learner goes by."""
    return t.resources_per_worker.get("GPU", 0) > 0


def engine_wakes_beside(cfg: TrainConfig) -> bool:
    """Whether an engine on the ranks' GPUs wakes into the memory a step leaves: colocated (a GPU shared, whatever
    the transport: LoRA's adapters too), asleep while the learner trains."""
    return cfg.engine.sleep_while_training and share_a_gpu(cfg.learner.resources_per_worker, cfg.serve.resources)


def zero_stage(t: LearnerConfig) -> int:
    """ZeRO partitions across ranks: one rank has nothing to partition, and stage 2's gradient copies cost ~7% of
    a step there (benchmarks/update_speed.py). In bf16, one rank takes stage 1 all the same: without a ZeRO
    optimizer DeepSpeed would step the bf16 weights themselves, with no fp32 master copy."""
    if t.zero_stage != "auto":
        return t.zero_stage
    if t.num_workers > 1 or t.offload_optimizer:  # offloading needs a ZeRO optimizer too
        return 2
    return 1 if learner_dtype(t) == "bfloat16" else 0


def batch_plan(transitions: list[Transition], alg: AlgorithmConfig, max_tokens: int, token_budget: int,
               ranks: int, share_prefix: bool = False) -> list[list[list[MicroBatch]]]:
    """Each rank's micro-batches, per mini-batch (algorithm.mini_batches, one optimizer step each; a strided split, so
    each holds part of every group). A transition without a learning signal (zero advantage) is left out, unless a
    KL or entropy term is in the loss, which acts on every token. Each mini-batch's loss weights normalize over it;
    every rank gets as many micro-batches in each as the others (some empty)."""
    regularized = alg.entropy_coef > 0 or (alg.kl_coef > 0 and alg.kl_penalty == "loss")
    batch = [t for t in transitions if regularized or has_signal(t, alg.estimator)]
    if not batch:
        raise ValueError("no transition with a learning signal: nothing to learn from")
    n = min(alg.mini_batches, len(batch))
    plan: list[list[list[MicroBatch]]] = [[] for _ in range(ranks)]
    for mini in (batch[i::n] for i in range(n)):
        # An adapter per agent: each micro-batch one adapter's, each adapter's loss normalized over its own tokens,
        # and every rank's j-th micro-batch the same adapter's (ZeRO-2 and 3 reduce each gradient as backward makes
        # it: the ranks must make the same ones), so each adapter's share is padded to a multiple of the ranks.
        packed = []
        for pool in (by_adapter(mini).values() if alg.adapters else [mini]):
            weighted = list(zip(pool, token_weights(pool, alg.loss_aggregation, max_tokens)))
            mbs = micro_batches(weighted, token_budget, share_prefix)
            packed += mbs + [[]] * (-len(mbs) % ranks if alg.adapters else 0)
        rounds = -(-len(packed) // ranks)
        for rank, mini_batches in enumerate(plan):
            mine = packed[rank::ranks]
            mini_batches.append(mine + [[]] * (rounds - len(mine)))
    return plan


def micro_batch_adapters(plan: list[list[list[MicroBatch]]]) -> list[list[str | None]]:
    """Per mini-batch, the adapter each micro-batch index runs with on every rank (batch_plan aligns them; a rank's
    empty one runs with the others'): what an adapter per agent trains, the others not moving."""
    return [[next((mb[0][0].adapter for rank in plan if (mb := rank[m][j])), None) for j in range(len(plan[0][m]))]
            for m in range(len(plan[0]))]


def micro_batches(weighted: MicroBatch, token_budget: int, share_prefix: bool = False) -> list[MicroBatch]:
    """Rows packed while the micro-batch's padded size stays within the budget, so its memory is bounded whatever the
    batch size; a row longer than the budget goes alone. Rows sorted by length; with share_prefix
    (learner.shared_prefix), by their prompts' tokens, so those alike sit together."""
    def length(tw) -> int:
        return len(tw[0].prompt_ids) + len(tw[0].response_ids)

    # big-endian bytes compare as the token lists do, at memcmp's speed
    order = (lambda tw: (np.asarray(tw[0].prompt_ids, ">u4").tobytes(), length(tw))) if share_prefix else length
    out: list[MicroBatch] = []
    for item in sorted(weighted, key=order):
        if out and padded_size([t for t, _ in out[-1]] + [item[0]], share_prefix) <= token_budget:
            out[-1].append(item)
        else:
            out.append([item])
    return out


def padded_size(rows: list[Transition], share_prefix: bool = False) -> int:
    """The tokens a micro-batch's forward runs over: rows × the longest, padding included; with share_prefix the
    prefix all rows share counted once."""
    shared = shared_prefix(rows) if share_prefix else 0
    return shared + len(rows) * (max(len(t.prompt_ids) + len(t.response_ids) for t in rows) - shared)


class _Restarted(Exception):
    """The ranks were restarted: `ready` holds the new processes' start messages heard so far."""

    def __init__(self, msg: dict):
        super().__init__(f"rank {msg['rank']} restarted")
        self.ready = {msg["rank"]: msg}
