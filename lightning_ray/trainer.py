"""The LightningRL training loop, top to bottom: tasks → rollouts by the unmodified agent → spans →
transitions → GRPO update → new weights on every serve replica → next iteration."""

from __future__ import annotations

import json
import random
import time
from contextlib import contextmanager

import ray
from openai import OpenAI
from ray import serve
from tqdm import tqdm

from lightning_ray.algorithm.grpo import group_advantages
from lightning_ray.algorithm.lightningrl import transitions_from_spans
from lightning_ray.config import TrainConfig
from lightning_ray.models import resolve_model_path
from lightning_ray.rollout.worker import RolloutWorker
from lightning_ray.serving.app import APP_NAME, deploy_policy
from lightning_ray.store.client import StoreClient
from lightning_ray.store.http import APP_NAME as STORE_APP
from lightning_ray.store.http import deploy_store_api
from lightning_ray.tasks import load_task
from lightning_ray.tracing import semconv
from lightning_ray.training.learner import Learner
from lightning_ray.training.weights import WeightRegistry
from lightning_ray.types import RolloutConfig

PROBE = [{"role": "user", "content": "What is 3 + 4?"}]  # a fixed prompt whose served logprobs track each update


def train(cfg: TrainConfig) -> list[dict]:
    run = cfg.run_path
    run.mkdir(parents=True, exist_ok=True)
    owns_ray = not ray.is_initialized()
    if owns_ray:
        ray.init(address=cfg.ray.address, num_cpus=cfg.ray.num_cpus if cfg.ray.address is None else None,
                 namespace="lightning_ray")
    model_path = resolve_model_path(cfg.model)
    task = load_task(cfg.task.name)
    dataset = task.make_tasks(cfg.task.train_size, cfg.task.seed)

    store = StoreClient.start(run, cfg.store.num_shards)
    attempts = RolloutConfig(max_attempts=cfg.rollout.max_attempts, timeout_seconds=cfg.rollout.timeout_seconds,
                             unresponsive_seconds=cfg.rollout.unresponsive_seconds)
    registry = WeightRegistry.remote()
    server_url = deploy_policy(
        str(model_path), cfg.model.name, store, registry, host=cfg.serve.host, port=cfg.serve.port,
        num_replicas=cfg.serve.num_replicas, autoscaling=cfg.serve.autoscaling, engine=cfg.engine.kind,
        engine_options={"dtype": cfg.engine.dtype, **cfg.engine.options}, max_model_len=cfg.engine.max_model_len,
        api_key=cfg.serve.api_key, defaults={"max_tokens": cfg.rollout.max_tokens, "temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p})
    workers = [RolloutWorker.remote(cfg.task.name, store, server_url, cfg.model.name, cfg.serve.api_key,
                                    cfg.rollout.tracing) for _ in range(cfg.rollout.num_workers)]
    print(f"policy served at {server_url}/v1 as {cfg.model.name!r}", flush=True)
    if cfg.store.http:
        store_url = deploy_store_api(store, cfg.serve.host, cfg.serve.port, cfg.serve.api_key)
        print(f"trace store at {store_url} (OTLP/HTTP: {store_url}/v1/traces)", flush=True)
    print("starting the learner ...", flush=True)
    learner = Learner(cfg, model_path, registry)
    probe = _probe(server_url, cfg)
    rng = random.Random(cfg.seed)
    history = []
    try:
        for iteration in range(cfg.trainer.iterations):
            phase = _PhaseTimer()
            with phase("rollout"):
                tasks = [t.model_copy(update={"group_id": f"{t.task_id}@{iteration}"})
                         for t in rng.sample(dataset, cfg.rollout.tasks_per_iteration)
                         for _ in range(cfg.rollout.group_size)]
                rollout_ids = [r.rollout_id for r in store.enqueue(tasks, attempts)]
                _run_rollouts(workers, store, rollout_ids, iteration)
            with phase("adapt"):
                rollouts = store.get_rollouts(rollout_ids)
                spans = store.query_spans(rollout_ids)
                transitions = group_advantages(
                    [t for r in rollouts
                     for t in transitions_from_spans(r, [s for s in spans if s.rollout_id == r.rollout_id], cfg.model.name)],
                    cfg.algorithm.normalize_std)
            with phase("train"):
                results = learner.step(transitions)
            with phase("sync"):
                version = results[0]["version"]
                ray.get(registry.wait_synced.remote(version, cfg.serve.sync_timeout_s))
            if (iteration + 1) % cfg.trainer.checkpoint_every == 0 or iteration + 1 == cfg.trainer.iterations:
                with phase("checkpoint"):
                    learner.save(run / "checkpoint")
            served_before, probe = probe, _probe(server_url, cfg)
            record = {
                "iteration": iteration,
                "reward_mean": sum(r.reward or 0.0 for r in rollouts) / len(rollouts),
                "rollouts": len(rollouts),
                "failed_rollouts": sum(r.status == "failed" for r in rollouts),
                "transitions": len(transitions),
                # a group whose rollouts all scored the same gives zero advantages: no learning signal
                "groups_with_signal": len({t.group_id for t in transitions if t.advantage != 0}),
                "llm_spans": sum(s.name == semconv.LLM_CALL for s in spans),
                "rollout_policy_versions": sorted({t.policy_version for t in transitions}),
                "policy_version": version,
                "served_policy_version": probe["version"],
                "probe_logprob_before": served_before["logprob_mean"],
                "probe_logprob_after": probe["logprob_mean"],
                "loss": sum(r["loss"] for r in results) / len(results),
                "clip_frac": sum(r["clip_frac"] for r in results) / len(results),
                "logprob_abs_diff": sum(r["logprob_abs_diff"] for r in results) / len(results),
                "worker_digests": [r["digest"] for r in results],
                "seconds": phase.seconds,
            }
            history.append(record)
            with open(run / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"iter {iteration}: reward {record['reward_mean']:.3f} | transitions {len(transitions)} | "
                  f"policy v{version} served | " + " ".join(f"{k} {v:.1f}s" for k, v in phase.seconds.items()),
                  flush=True)
    finally:
        learner.close()
        serve.delete(APP_NAME)
        if cfg.store.http:
            serve.delete(STORE_APP)
        if owns_ray:
            ray.shutdown()
    return history


def _run_rollouts(workers, store: StoreClient, rollout_ids: list[str], iteration: int) -> None:
    """Workers drain the queue; when they are done but rollouts are still open (attempts that failed, timed out or
    went silent and were requeued), send them again. A worker's crash is raised here."""
    with tqdm(total=len(rollout_ids), desc=f"iter {iteration} rollouts", leave=False) as bar:
        work = [w.work.remote() for w in workers]
        while True:
            ended = len(store.wait_for_rollouts(rollout_ids, timeout=0.5))
            bar.update(ended - bar.n)
            if work:
                done, work = ray.wait(work, num_returns=len(work), timeout=0)
                ray.get(done)
            if ended == len(rollout_ids):
                ray.get(work)
                return
            if not work:
                work = [w.work.remote() for w in workers]


def _probe(server_url: str, cfg: TrainConfig) -> dict:
    """Greedy-decode a fixed prompt through the real API: its logprobs move when the served weights do."""
    client = OpenAI(base_url=f"{server_url}/v1", api_key=cfg.serve.api_key or "EMPTY", max_retries=0)
    out = client.chat.completions.create(model=cfg.model.name, messages=PROBE, temperature=0, max_tokens=8,
                                         logprobs=True)
    lps = [c.logprob for c in out.choices[0].logprobs.content]
    return {"version": int(out.system_fingerprint.rsplit("v", 1)[1]), "logprob_mean": sum(lps) / max(len(lps), 1)}


class _PhaseTimer:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[name] = round(time.perf_counter() - start, 3)
