"""What a run stands on, started in one place for training and evaluation alike: Ray, the trace store, the weight
registry, the policy server (and the store's HTTP API), the rollout workers; and the one thing they do together,
run a set of rollouts to their end."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import IO

import ray

from lightning_ray.config import ConfigError, TrainConfig
from lightning_ray.learner.checkpoint import Checkpoint
from lightning_ray.metrics import name_run
from lightning_ray.models import check_model, resolve_adapter, resolve_model_path
from lightning_ray.placement import ON_HEAD, actor_options, share_a_gpu
from lightning_ray.rollout.dispatch import run_to_end
from lightning_ray.rollout.worker import RolloutWorker
from lightning_ray.serving.app import APP_NAME, policy_target
from lightning_ray.serving.deploy import delete_apps, start_apps, wait_running
from lightning_ray.serving.routing import DIRECT_INGRESS
from lightning_ray.store.client import StoreClient
from lightning_ray.store.http import ROUTE_PREFIX as STORE_PREFIX
from lightning_ray.store.http import store_api_target
from lightning_ray.terminal import console, status
from lightning_ray.types import AttemptPolicy, Rollout, Task
from lightning_ray import weight_sync
from lightning_ray.weight_sync.registry import WeightRegistry


def learner_waits_for_engine(cfg: TrainConfig) -> bool:
    """Whether the learner's ranks must wait for the policy server: vLLM on a GPU sizes its memory from what is free
    before and after it profiles at its start, and fails the start where free memory rose meanwhile ("Error in
    memory profiling"), so a learner rank loading on its GPU at the same time (fractions of one GPU on both:
    placement=colocated) would take the engine's share or end its start."""
    return cfg.engine.kind == "vllm" and share_a_gpu(cfg.learner.resources_per_worker, cfg.serve.resources)


def check_gpus(cfg: TrainConfig, learner: bool, detected: float) -> None:
    """Refuses a run whose placement asks for more GPUs than this machine's Ray detected (none: a container started
    without its GPUs, a driver NVML cannot reach, a CPU machine)."""
    s, t = cfg.serve, cfg.learner
    replicas = s.autoscaling.get("min_replicas", 1) if s.autoscaling else s.num_replicas
    # colocated's halves add up to one
    asked = s.resources.get("GPU", 0) * replicas + (t.resources_per_worker.get("GPU", 0) * t.num_workers if learner
                                                    else 0)
    if asked > detected + 1e-6:  # fractions' sums: 0.2 x 3 + 0.8 x 3 is 9.000000000000002
        raise ConfigError(f"the run asks for {asked:g} GPUs (serve.resources.GPU x replicas"
                          + (", learner.resources_per_worker.GPU x learner.num_workers" if learner else "")
                          + f": a GPU placement), and Ray detected {detected:g} on this machine: check that "
                          "nvidia-smi sees them here, or placement=cpu")


def _tried(refs: list[ray.ObjectRef], timeout: float) -> None:
    """Waits for the calls, whatever their ends (each ran where its actor lives)."""
    with contextlib.suppress(ray.exceptions.RayError):
        ray.get(refs, timeout=timeout)


def hold_run_dir(run_path: Path) -> IO:
    """The run directory, locked for this process while it runs (released when it ends, however it ends): a second
    job given it would overwrite its config.yaml, share its store and queue, and empty its metrics.jsonl."""
    lock = open(run_path / ".lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        raise ConfigError(f"run_dir: {run_path} is in use by a run still running ({holder}): give another run_dir, "
                          "or stop that run first") from None
    lock.truncate(0)
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    lock.flush()
    return lock


def check_port(host: str, port: int, tries: int = 5) -> None:
    """Refuses a Serve port another program listens on, before a local cluster starts: Serve's proxy would fail to
    bind it half a minute later, in a page of traceback. Asked again for a few seconds: a cluster stopped just
    before (a benchmark's previous setting) may hold it while its proxy exits."""
    for attempt in range(tries):
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Serve's: a closed run's TIME_WAIT is free
            try:
                probe.bind((host, port))
                return
            except OSError as e:
                taken = e.strerror
        time.sleep(1 if attempt < tries - 1 else 0)
    raise ConfigError(f"serve.port={port}: {host}:{port} is taken ({taken}), another run's policy server's perhaps: "
                      "choose another serve.port")


class Services:
    def __init__(self, cfg: TrainConfig, rollout_workers: bool = True, learner: bool = False,
                 resume: Checkpoint | None = None):
        """rollout_workers=False: the policy and the store only, for agents that run elsewhere (jobs/serve.py);
        learner=True: the learner too (learner/driver.py), its ranks starting while the policy server does (after
        it where vLLM shares their GPU: learner_waits_for_engine);
        resume: a checkpoint of this run to go on from (its policy served as its version, the learner's state
        loaded, the rollouts the stopped run left unfinished cancelled). What started is stopped again if a later
        part fails to start."""
        self.cfg, self.learner, self.apps, self.signals = cfg, None, [], {}
        self.store, self.registry, self.workers = None, None, []
        cfg.run_path.mkdir(parents=True, exist_ok=True)
        self.lock = hold_run_dir(cfg.run_path)
        cfg.save(cfg.run_path / "config.yaml")
        print(f"run directory: {cfg.run_path}", flush=True)
        self.owns_ray, self.phase = not ray.is_initialized(), "Ray"
        self.start_seconds: dict[str, float] = {}  # each part's start, in order: where a slow start's time went
        self._since = time.perf_counter()
        try:
            try:  # a model not there: said before Ray's start (a traceback half a minute in, before)
                check_model(cfg.model)
            except FileNotFoundError as e:
                raise ConfigError(str(e)) from None
            if self.owns_ray:
                if cfg.ray.address is None and "RAY_ADDRESS" not in os.environ:  # a cluster of its own: its port
                    check_port(cfg.serve.host, cfg.serve.port)
                self._start_ray(cfg, learner)
            self._start(cfg, rollout_workers, learner, resume)
            self._starting(None)
        except BaseException as e:
            e.add_note(f"while starting {self.phase} (what had started is stopped)")  # the part, in the traceback
            with contextlib.suppress(Exception):  # the start's own error is the one to see
                self.__exit__()
            raise

    def _starting(self, phase: str | None) -> None:
        """The part started last is timed, `phase` is next (None: all started, said on the terminal)."""
        now = time.perf_counter()
        self.start_seconds[self.phase] = round(now - self._since, 2)
        self.phase, self._since = phase, now
        if phase is None:
            parts = ", ".join(f"{name} {s:.1f}" for name, s in self.start_seconds.items())
            console.print(f"started in {sum(self.start_seconds.values()):.1f} s ({parts})")

    def _start_ray(self, cfg: TrainConfig, learner: bool) -> None:
        local = cfg.ray.address is None
        if local and cfg.serve.direct_ingress:  # read by Serve's controller and replicas as they start
            os.environ.update(DIRECT_INGRESS)
        if local:  # a component given no GPU sees none (Ray leaves such a worker's CUDA_VISIBLE_DEVICES as it is):
            # on a GPU node placement=cpu then means CPUs, not an engine taking the GPU beside a learner on CPUs
            os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "1")
        # A run starts ~12 worker processes at once (store, registry, rollout workers, Serve's controller, proxy
        # and replicas, Ray Train's controller and ranks): Ray expects one per CPU, and its warning would say so
        # on every small machine.
        context = ray.init(address=cfg.ray.address, namespace="lightning_ray", log_to_driver=cfg.verbose,
                           **({"num_cpus": cfg.ray.num_cpus, "_metrics_export_port": cfg.ray.metrics_export_port,
                               "_system_config": {"worker_maximum_startup_concurrency": 16}} if local else {}))
        _link_ray_logs(context.address_info["session_dir"], cfg.run_path / "logs")
        if threading.current_thread() is threading.main_thread():
            # ray.init's SIGTERM handler aborts the driver 3 s later, its parts unstopped, no resume line: `ray job
            # stop`, `kill`, a pod's stop end the run as Ctrl-C does; and Ctrl-C works where a shell started it
            # with SIGINT ignored (a script's background job). Restored at the exit.
            self.signals = {s: signal.signal(s, signal.default_int_handler) for s in (signal.SIGTERM, signal.SIGINT)}
        if local:  # else the replicas or ranks would wait for GPUs for ever, behind a spinner (a cluster may grow)
            check_gpus(cfg, learner, ray.cluster_resources().get("GPU", 0))
        if context.dashboard_url:
            console.print(f"Ray dashboard at http://{context.dashboard_url} (metrics: lightning_ray_*)")

    def _start(self, cfg: TrainConfig, rollout_workers: bool, learner: bool, resume: Checkpoint | None) -> None:
        self._starting("the model")
        with status("building the model"):
            self.model_path: Path = resolve_model_path(cfg.model)
            adapter = resolve_adapter(cfg.model)  # before anything starts: a wrong one fails here, named
        label = cfg.run_path.name  # names that read well in the Ray dashboard, unique per run
        name_run(label)  # the driver's gauges (Ray is up, this process's or the caller's)
        # Serve's apps are the cluster's ("policy" at /, "store"): a second run would replace the first's policy
        # server with its own, its weight syncs then waiting for ever. A run lives while its registry does.
        if others := sorted(name.split("@", 1)[1] for name in ray.util.list_named_actors()
                            if name.startswith("weight-registry@") and name != f"weight-registry@{label}"):
            raise ConfigError(f"ray.address: another run ({', '.join(others)}) is running on this Ray cluster, and "
                              "this one would replace its policy server: one run per cluster at a time (stop it, or "
                              "give this run a cluster of its own)")
        self.queue = f"run@{label}"  # this run's rollouts, taken by its own workers only (types.Rollout.queue)
        # On the head, beside the driver: the store's SQLite files are the run directory's.
        self._starting("the trace store")
        self.store = StoreClient.start(cfg.run_path, cfg.store.num_shards, label=label, actor_options=ON_HEAD)
        # a training run in a directory a stopped run left (resume=; or none, where it stopped before a checkpoint):
        # that run's unfinished rollouts, which no worker waits for (a new run's workers took them first)
        if learner and (left := self.store.query_rollouts(status=["queued", "requeued", "running"])):
            self.store.cancel([r.rollout_id for r in left])
        self.attempts = AttemptPolicy(max_attempts=cfg.rollout.max_attempts,
                                      timeout_seconds=cfg.rollout.timeout_seconds,
                                      unresponsive_seconds=cfg.rollout.unresponsive_seconds,
                                      timeout_policy=cfg.rollout.timeout_policy)
        # on the head too: the versions and who holds them die with no worker node (a node's death took it, and
        # the run, in benchmarks/soak.py)
        self._starting("the weight registry")
        self.registry = WeightRegistry.options(name=f"weight-registry@{label}", **ON_HEAD).remote(
            resume.state.policy_version if resume else 0)
        learner_after_server = learner and learner_waits_for_engine(cfg)
        if learner and not learner_after_server:  # ~5 s sooner ready than one after the other, on 2 cores
            self._start_learner(cfg, resume)
        # The rollout workers and both apps start at once, their processes booting while the policy's replica loads;
        # an agent that cannot load fails the start before the engine is up, named. Each worker runs
        # agents_per_worker agents at once (threads): the engine batches their calls. A worker that dies is
        # restarted by Ray, and its attempts retried by the store (rollout.max_attempts).
        self.server_url = f"http://{cfg.serve.host}:{cfg.serve.port}"
        if rollout_workers:  # `serve`, `eval` from a store: none
            self._starting("the rollout workers")
        for i in range(cfg.rollout.num_workers if rollout_workers else 0):  # one by one: a failure stops those before
            self.workers.append(RolloutWorker.options(
                name=f"rollout-worker-{i}@{label}", max_concurrency=cfg.rollout.agents_per_worker, max_restarts=-1,
                runtime_env=cfg.task.runtime_env, **actor_options(cfg.rollout.resources),
            ).remote(cfg.task, self.server_url, cfg.model.name, cfg.serve.api_key, cfg.rollout.tracing,
                     cfg.rollout.timeout_seconds, cfg.rollout.max_abandoned_agents, self.queue,
                     (APP_NAME, f"weight-registry@{label}") if cfg.serve.direct_ingress else None))
        # a resumed run serves its checkpoint's policy; when LoRA ships adapters, the base and the checkpoint's
        # adapters on it (the versions after it are adapters: the engines must keep the base); else model.adapter
        served, adapter = ((self.model_path, resume.path / "adapter") if weight_sync.of_run(cfg) == "adapter"
                           else (resume.policy, None)) if resume else (self.model_path, adapter)
        apps = [policy_target(cfg, str(served), self.store, self.registry, adapter)]
        if cfg.store.http:
            apps.append(store_api_target(self.store, cfg.serve.api_key))
        self.apps = [app.name for app in apps]  # deleted at exit, even if one fails to deploy
        self._starting(f"the policy server ({cfg.engine.kind} engine)" + (" and the rollout workers" if self.workers
                                                                           else ""))
        with status(f"starting {self.phase}"):
            start_apps(apps, cfg.serve.host, cfg.serve.port)
            ray.get([w.__ray_ready__.remote() for w in self.workers])
            wait_running(self.apps)
        console.print(f"policy served at {self.server_url}/v1 as {cfg.model.name!r}")
        if cfg.store.http:
            store_url = self.server_url + STORE_PREFIX
            console.print(f"trace store at {store_url} (OTLP/HTTP: {store_url}/v1/traces)")
        if learner_after_server:
            self._start_learner(cfg, resume)
        if self.learner:
            self._starting("the learner's ranks (Ray Train with DeepSpeed)")
            with status(f"starting {self.phase}"):
                self.learner.wait_ready()

    def _start_learner(self, cfg: TrainConfig, resume: Checkpoint | None) -> None:
        # imported here: torch and Ray Train take ~2 CPU-s, which `eval` and `serve` need not pay
        from lightning_ray.learner.driver import Learner

        self._starting("the learner")
        self.learner = Learner(cfg, self.model_path, self.registry, resume)

    def __enter__(self) -> Services:
        return self

    def __exit__(self, *exc) -> None:
        """Stops every part, each whatever happened to the others (a part already gone, its node lost, must not
        leave the rest running); the first failure is raised once all were tried."""
        interrupted = bool(exc) and isinstance(exc[1], KeyboardInterrupt)
        if interrupted:
            console.print("stopping (Ctrl-C again stops at once) ...")
        steps = [self.learner.stop] if self.learner else []  # its ranks shut down while the apps are deleted
        steps += [lambda: delete_apps(self.apps)] if self.apps else []
        # a rank reads its stop after its step (a minute, for a big one): interrupted, Ray's shutdown ends it instead
        steps += [lambda: self.learner.close(5 if interrupted and self.owns_ray else 60)] if self.learner else []
        # A command agent runs in a session of its own, which the worker's death leaves running: stopped first (a
        # worker gone with its node, or restarting, has none to stop: no failure of the run's)
        steps += [lambda: _tried([w.stop_agents.remote() for w in self.workers], 30)] if self.workers else []
        # Named, the run's actors would outlive it in a driver that goes on (a notebook, the tests' one cluster):
        # Serve keeps the handles a deleted app was deployed with.
        steps += [lambda actor=actor: ray.kill(actor, no_restart=True)
                  for actor in [*self.workers, *([self.registry] if self.registry else [])]]
        steps += [self.store.close] if self.store else []
        steps += [ray.shutdown] if self.owns_ray else []
        steps += [lambda: [signal.signal(s, handler) for s, handler in self.signals.items()], self.lock.close]
        failure = None
        for step in steps:
            try:
                step()
            except Exception as e:
                failure = failure or e
        if failure:
            raise failure

    def sleep_engines(self) -> None:
        """Every replica's engine frees its GPU memory for the learner (engine.sleep_while_training); the next
        published version wakes them."""
        epoch = ray.get(self.registry.request_sleep.remote())
        ray.get(self.registry.wait_asleep.remote(epoch, self.cfg.serve.sync_timeout_s))

    def wake_engines(self) -> None:
        """The sleeping engines wake on the weights they hold (an update that published no version to wake them)."""
        ray.get(self.registry.request_wake.remote())

    def run_rollouts(self, tasks: list[Task], desc: str) -> list[Rollout]:
        """Queue a rollout per task and run them all to their end (rollout/dispatch.py)."""
        rollout_ids = [r.rollout_id for r in self.store.enqueue(tasks, self.attempts, self.queue)]
        return run_to_end(self.store, self.workers, self.cfg.rollout.agents_per_worker, rollout_ids, desc)


def _link_ray_logs(session_dir: str, log_dir: Path) -> None:
    """<run_dir>/logs/ray: the Ray session's log files (every worker's, Serve's, the dashboard's), found from the
    run."""
    log_dir.mkdir(parents=True, exist_ok=True)
    link = log_dir / "ray"
    if link.is_symlink():  # an earlier start's (a resumed run, a run directory used again): its session may be gone
        link.unlink()
    if not link.exists():
        link.symlink_to(Path(session_dir) / "logs", target_is_directory=True)
