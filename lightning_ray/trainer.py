"""The LightningRL training loop, top to bottom: tasks → rollouts by the unmodified agent → spans → transitions →
policy update (GRPO, PPO, ...) → new weights on every serve replica → next iteration; held-out evaluation along the way."""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from contextlib import contextmanager

import ray
from openai import OpenAI

from lightning_ray.algorithm.advantages import best_rollouts, compute_advantages
from lightning_ray.algorithm.air import air_spans
from lightning_ray.algorithm.dynamic_sampling import sample_groups
from lightning_ray.algorithm.lightningrl import adapt, recorded_calls, spans_read
from lightning_ray.algorithm.select import Selection
from lightning_ray.config import TrainConfig
from lightning_ray.evaluation import evaluate
from lightning_ray.learner import checkpoint
from lightning_ray.learner.checkpoint import LoopState
from lightning_ray.metrics import metrics
from lightning_ray.record import iteration_record, line, summary
from lightning_ray.report import plot_learning_curve
from lightning_ray.services import Services
from lightning_ray.tasks import load_splits
from lightning_ray.terminal import status
from lightning_ray.types import Task, Transition

PROBE = [{"role": "user", "content": "What is 3 + 4?"}]  # a fixed prompt whose served logprobs track each update


def train(cfg: TrainConfig) -> list[dict]:
    run, t, alg = cfg.run_path, cfg.trainer, cfg.algorithm
    resume = checkpoint.resume_point(cfg)
    with Services(cfg, learner=True, resume=resume) as services:
        train_tasks, held_out, learner = *load_splits(cfg.task), services.learner
        rng = random.Random(cfg.seed)
        select = Selection.of(cfg.model.name, alg.select.models, alg.select.agents)  # which calls are the policy's
        history, evals, started, first = [], [], [], 0  # started: each iteration's start (span retention cuts there)
        if resume:  # as the stopped run stood after its checkpoint's iteration; later lines of metrics.jsonl go
            state = resume.state
            history, evals, started, first = state.history, state.evals, state.started, state.next_iteration
            rng.setstate(state.random_state())
            (run / "metrics.jsonl").write_text("".join(json.dumps(line(r)) + "\n" for r in history))
            print(f"resumed from {resume.path.name}: iteration {first}, policy v{state.policy_version}", flush=True)
        elif t.eval_every:
            evals.append({"after": 0, **evaluate(services, held_out, cfg.eval.pass_k, "eval before")})
            print(f"held-out accuracy before training: {evals[-1]['accuracy']:.3f}", flush=True)
        probe = _probe(services.server_url, cfg)
        deadline = time.monotonic() + 60 * t.max_minutes if t.max_minutes else float("inf")
        for iteration in range(first, t.iterations):
            phase = _PhaseTimer()
            started.append(time.time())
            rollouts, spans, adapted = [], [], Counter()  # of every round

            def rollout_round(tasks: list[Task]) -> list[Transition]:  # a group of rollouts per task
                with phase("rollout"):
                    groups = [task.model_copy(update={"group_id": f"{task.task_id}@{iteration}"})
                              for task in tasks for _ in range(cfg.rollout.group_size)]
                    done = services.run_rollouts(groups, f"iter {iteration} rollouts")
                with phase("adapt"):
                    found = services.store.query_spans([r.rollout_id for r in done],
                                                       name=spans_read(select, cfg.task.air.enabled))
                    if cfg.task.air.enabled:  # stored with the trace, where each sits beside the call it judges
                        air = air_spans(found, cfg.task.air, lambda sp: select.calls(recorded_calls(sp), sp))
                        services.store.add_spans(air, origin="server")
                        found += air
                    transitions, counts = adapt(done, found, cfg.model.name, alg.level, cfg.task.agent_rewards,
                                                select)
                    transitions = (best_rollouts(transitions, alg.sft_min_reward) if alg.objective == "sft" else
                                   compute_advantages(transitions, alg.estimator, alg.credit, alg.gamma,
                                                      alg.baseline))
                    if alg.overlong_filter:  # a cut-off answer's reward says little about it: left out of the loss
                        transitions = [tr for tr in transitions if tr.finish_reason != "length"]
                rollouts.extend(done)
                spans.extend(found)
                adapted.update(counts)
                return transitions

            # one round of tasks_per_iteration groups; with dynamic sampling, more rounds for the groups whose
            # rollouts all scored the same (zero advantages: no learning signal; a critic still has one, its
            # baseline being the value head, not the group)
            rounds = alg.max_sampling_rounds if alg.dynamic_sampling else 1
            tasks = rng.sample(train_tasks, min(cfg.rollout.tasks_per_iteration * rounds, len(train_tasks)))
            transitions, sampling = sample_groups(tasks, cfg.rollout.tasks_per_iteration, rounds, rollout_round,
                                                  alg.estimator)
            results = []
            last = iteration + 1 == t.iterations or time.monotonic() >= deadline
            if sampling["groups_with_signal"]:  # else the policy stays as it is: no step, no new version
                # versions the learner is ahead of the oldest policy that generated this data
                metrics().staleness.set(learner.version - min(tr.policy_version for tr in transitions))
                with phase("train"), status(f"iter {iteration}: training on {len(transitions)} transitions",
                                            report=False):
                    if cfg.engine.sleep_while_training:  # the GPU they share is the learner's till the sync
                        services.sleep_engines()
                    results = learner.step(transitions)
                with phase("sync"), status(f"iter {iteration}: syncing weights", report=False):
                    ray.get(services.registry.wait_synced.remote(learner.version, cfg.serve.sync_timeout_s))
                metrics().weight_sync_seconds.observe(phase.seconds["sync"])
            if t.eval_every and ((iteration + 1) % t.eval_every == 0 or last):
                with phase("eval"):
                    evals.append({"after": iteration + 1, **evaluate(services, held_out, cfg.eval.pass_k,
                                                                     f"eval after {iteration + 1}")})
            record = iteration_record(iteration, rollouts, spans, transitions, adapted, sampling, learner.version,
                                      results, phase.seconds)
            if results:
                served_before, probe = probe, _probe(services.server_url, cfg)
                record.update({"served_policy_version": probe["version"],
                               "probe_logprob_before": served_before["logprob_mean"],
                               "probe_logprob_after": probe["logprob_mean"]})
            if iteration == 0 and evals:
                record["eval_before"] = evals[0]
            if evals and evals[-1]["after"] == iteration + 1:
                record["eval"] = evals[-1]
            history.append(record)
            if (iteration + 1) % t.checkpoint_every == 0 or last:  # after the record: the checkpoint holds it
                with phase("checkpoint"), status(f"iter {iteration}: checkpoint", report=False):
                    staged = checkpoint.staging(run, iteration + 1)
                    learner.save(staged)
                    checkpoint.commit(staged, LoopState(
                        next_iteration=iteration + 1, policy_version=learner.version, rng_state=rng.getstate(),
                        evals=evals, started=started, history=history), t.keep_checkpoints)
            _export(record)
            with open(run / "metrics.jsonl", "a") as f:
                f.write(json.dumps(line(record)) + "\n")  # its fields are docs/01-training.md's table
            print(summary(record), flush=True)
            if (keep := cfg.store.keep_iterations) and iteration >= keep:  # the last `keep` iterations' spans stay
                services.store.delete_spans(before=started[iteration - keep + 1])
            if last:
                break
        if history:
            title = f"{cfg.task.dataset} · {cfg.model.path or 'tiny test model'}"
            plot_learning_curve(history, evals, run / "learning_curve.png", title)
        if len(evals) > 1:
            print(f"held-out accuracy: {evals[0]['accuracy']:.3f} before → {evals[-1]['accuracy']:.3f} after "
                  f"{evals[-1]['after']} iterations ({len(held_out)} problems)", flush=True)
    return history


def _export(record: dict) -> None:
    """The iteration's outcome on the Ray dashboard (lightning_ray/metrics.py)."""
    metrics().reward_mean.set(record["reward_mean"])
    metrics().transitions.inc(record["transitions"])
    metrics().policy_version.set(record["policy_version"], tags={"role": "trained"})


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
        self.seconds[name] = round(self.seconds.get(name, 0.0) + time.perf_counter() - start, 3)  # over rounds
