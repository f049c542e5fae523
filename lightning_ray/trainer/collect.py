"""Collect a batch: a group of rollouts per task by the unmodified agent, their spans read back from the store
(AIR's intermediate rewards stored beside them), LightningRL's transitions with their advantages; with dynamic
sampling, more rounds for the groups whose rollouts all scored the same."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from itertools import zip_longest

from lightning_ray.algorithm.advantages import best_rollouts, compute_advantages
from lightning_ray.algorithm.air import air_spans
from lightning_ray.algorithm.dynamic_sampling import sample_groups
from lightning_ray.algorithm.lightningrl import adapt, recorded_calls, spans_read
from lightning_ray.algorithm.select import by_adapter
from lightning_ray.serving.teacher import TAUGHT
from lightning_ray.trainer.record import common_errors, most_often
from lightning_ray.trainer.run import PhaseTimer, Run
from lightning_ray.types import Rollout, Span, Task, Transition


class RolloutsFailed(RuntimeError):
    """Every rollout of an iteration's first round failed on the platform's side (no reward): an agent that cannot
    start, an endpoint it cannot reach. Every further iteration would fail the same way, training nothing."""

    def __init__(self, iteration: int, rollouts: list[Rollout]):
        said = most_often(common_errors(rollouts), width=300)
        super().__init__(f"every rollout of iteration {iteration} ({len(rollouts)}) failed on the platform's side, "
                         f"so the run stops: {said} (each attempt's error: lightning-ray store export <run_dir> "
                         "--what rollouts)")


class NoPolicyCalls(RolloutsFailed):
    """No rollout of an iteration's first round made a call the policy server recorded as the policy's: an agent that
    calls a URL of its own (not the base URL it is given), or no model; or a selection that picks none of its calls.
    Every iteration would train nothing, its line saying "no signal"."""

    def __init__(self, iteration: int, rollouts: list[Rollout], recorded: int):
        failed = sum(r.status == "failed" for r in rollouts)
        said = most_often(common_errors(rollouts), width=300)
        why = (f"the server recorded {recorded} call(s) under them, none the policy's as algorithm.select picks them "
               "(model.name, select.models, select.agents)" if recorded else
               "none reached the policy server under its rollout: does the agent use the base URL it is given "
               "(base_url, OPENAI_BASE_URL), not one of its own, and call the model at all?")
        RuntimeError.__init__(self, f"no rollout of iteration {iteration} ({len(rollouts)}) made a call the policy can "
                              f"be trained on, so the run stops: {why}"
                              + (f" ({failed} failed, most often: {said})" if failed else ""))


@dataclass
class Batch:
    """What an iteration collected, over every sampling round (the groups dynamic sampling dropped included)."""

    iteration: int
    rollouts: list[Rollout] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    transitions: list[Transition] = field(default_factory=list)
    adapted: Counter = field(default_factory=Counter)  # the adapter's counts (policy calls, prefix breaks, ...)
    sampling: dict = field(default_factory=dict)  # dynamic sampling's counts (rounds, groups with a signal, dropped)
    phase: PhaseTimer = field(default_factory=PhaseTimer)  # its seconds: the iteration's, from its collection on


def sampling_rounds(run: Run) -> int:
    return run.cfg.algorithm.max_sampling_rounds if run.cfg.algorithm.dynamic_sampling else 1


def draw(run: Run) -> list[Task]:
    """A batch's tasks, from the run's sampler: the first round's and those dynamic sampling may need; with
    task.balance, a task of each of its values in turn (in an order drawn anew each batch), none drawn twice."""
    wanted = min(run.cfg.rollout.tasks_per_iteration * sampling_rounds(run), len(run.train_tasks))
    if not (key := run.cfg.task.balance):
        return run.rng.sample(run.train_tasks, wanted)
    strata = defaultdict(list)
    for task in run.train_tasks:
        strata[str(task.input[key])].append(task)  # as evaluate reports them
    pools = list(strata.values())
    run.rng.shuffle(pools)  # which value comes first
    pools = [run.rng.sample(pool, len(pool)) for pool in pools]
    return [task for turn in zip_longest(*pools) for task in turn if task is not None][:wanted]


def collect(run: Run, iteration: int, tasks: list[Task]) -> Batch:
    cfg, alg = run.cfg, run.cfg.algorithm
    batch = Batch(iteration)

    def rollout_round(tasks: list[Task]) -> list[Transition]:
        with batch.phase("rollout"):
            # an imitation run's rollouts are its teacher's to answer (serving/teacher.py)
            taught = {TAUGHT: True} if cfg.teacher.kind != "none" else {}
            groups = [task.model_copy(update={"group_id": f"{task.task_id}@{iteration}",
                                              "sampling": {**task.sampling, **taught}})
                      for task in tasks for _ in range(cfg.rollout.group_size)]
            done = run.services.run_rollouts(groups, f"iter {iteration} rollouts")
        # the iteration's first round only: a later one may be a single group (dynamic sampling's refill)
        if done and not batch.rollouts and all(r.status == "failed" and r.reward is None for r in done):
            raise RolloutsFailed(iteration, done)
        with batch.phase("adapt"):
            found = run.services.store.query_spans([r.rollout_id for r in done],
                                                   name=spans_read(run.select, cfg.task.air.enabled))
            if cfg.task.air.enabled:  # stored with the trace, where each sits beside the call it judges
                air = air_spans(found, cfg.task.air, lambda sp: run.select.calls(recorded_calls(sp), sp))
                run.services.store.add_spans(air, origin="server")
                found += air
            transitions, counts = adapt(done, found, cfg.model.name, alg.level, cfg.task.agent_rewards, run.select,
                                        imitation=alg.objective == "sft")
            if not batch.rollouts and not counts["policy_calls"]:  # (the first round, as above)
                raise NoPolicyCalls(iteration, done, len(recorded_calls(found)))
            if alg.adapters:  # the base's calls (of agents no adapter names) train nothing: it is frozen
                base = [tr for tr in transitions if tr.adapter not in alg.adapters]
                counts["base_calls"] = sum(len(tr.call_tokens or [0]) for tr in base)
                transitions = [tr for tr in transitions if tr.adapter in alg.adapters]
            # each adapter's calls under advantages of their own (algorithm.adapters; else one pool for all)
            transitions = [tr for pool in by_adapter(transitions).values() for tr in (
                best_rollouts(pool, alg.sft_min_reward) if alg.objective == "sft" else
                compute_advantages(pool, alg.estimator, alg.credit, alg.gamma, alg.baseline))]
            if alg.overlong_filter:  # a cut-off answer's reward says little about it: left out of the loss
                transitions = [tr for tr in transitions if tr.finish_reason != "length"]
        batch.rollouts += done
        batch.spans += found
        batch.adapted.update(counts)
        return transitions

    # one round of tasks_per_iteration groups; with dynamic sampling, more rounds for the groups whose rollouts all
    # scored the same (zero advantages: no learning signal; a critic still has one, its baseline being the value
    # head, not the group)
    batch.transitions, batch.sampling = sample_groups(tasks, cfg.rollout.tasks_per_iteration, sampling_rounds(run),
                                                      rollout_round, alg.estimator)
    return batch
