"""One line of <run_dir>/metrics.jsonl: what an iteration did. Each field's description is its row of the table in
docs/01-training.md (`python -m lightning_ray.trainer.record` prints the table; tests/unit/test_record.py keeps the
two the same)."""

from __future__ import annotations

import re
import statistics
from collections import Counter
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from lightning_ray.algorithm.lightningrl import recorded_calls, scored_faithfully
from lightning_ray.algorithm.select import by_adapter


def described(description: str, optional: bool = False) -> Any:
    """A field and its row of the table; optional: absent from lines it does not apply to."""
    return Field(None, description=description) if optional else Field(description=description)


class IterationRecord(BaseModel):
    """Rollouts, spans and transitions count every sampling round, whether their group was trained on or dropped.
    The fields from `loss` on are there only when the iteration updated the policy; `eval_before` and `eval` when it
    evaluated."""

    model_config = ConfigDict(extra="forbid")

    iteration: int = described("the iteration, from 0")
    reward_mean: float = described("mean reward of the iteration's rollouts (a rollout without one counts 0)")
    rollouts: int = described("rollouts run, dropped groups included")
    failed_rollouts: int = described(
        "rollouts that failed: the agent crashed or the policy's answer broke it (scored 0), or the platform failed "
        "them (`infra_failed_rollouts`)")
    infra_failed_rollouts: int = described(
        "the platform's failures: no reward, or not a finite one; left out of training")
    rollout_errors: dict[str, int] | None = described(
        "the failed rollouts' most common errors (up to 3, each by its first and last lines) and how many said each",
        optional=True)
    transitions: int = described(
        "training sequences made of the policy's calls (one per call, or per rollout at `algorithm.level=trajectory`)")
    policy_calls: int = described("the policy's calls the adapter read")
    unanswered_calls: int = described(
        "the policy's calls left out because the agent never got their answer (errored, aborted, no finish reason)")
    truncation_rate: float = described(
        "share of the policy's calls cut off at `max_tokens` (left out of the loss with "
        "`algorithm.overlong_filter=true`)")
    calls_across_updates: int = described(
        "the policy's calls a weight update landed in, kept going under the new weights (`serve.drain=keep`)")
    prefix_break_rate: float = described(
        "share of an episode's consecutive calls whose prompt did not extend the previous context (re-tokenization "
        "drift)")
    sampling_rounds: int = described("rounds of rollouts run (1 without `algorithm.dynamic_sampling`)")
    groups_with_signal: int = described(
        "groups trained on: GRPO groups whose returns differed (`objective=sft`: whose best rollout reached "
        "`sft_min_reward`)")
    groups_dropped: int = described("groups run without a signal, left out")
    llm_spans: int = described("LLM calls recorded by the policy server")
    unfaithfully_scored_calls: int = described(
        "calls the learner cannot score as they were sampled (greedy, top-p < 1, grammar-constrained)")
    action_tokens_mean: float = described("the policy's own tokens per rollout (the response-length curve)")
    response_diversity: float = described(
        "distinct responses per rollout within a group: falls towards 1 / group size as exploration collapses")
    rollout_policy_versions: list[int] = described("the policy versions that generated the transitions")
    policy_version: int = described("the learner's version after the update")
    updated: bool = described(
        "whether the policy was updated (not when no group had a signal, or every step was skipped)")
    seconds: dict[str, float] = described(
        "per phase: rollout, adapt, train, sync, eval, checkpoint; `rollout.mode=async`: wait (the learner waiting for "
        "the batch), and rollout and adapt ran while the update before trained")
    idle_seconds: dict[str, float] = described(
        "`learner`: waiting for the batch (`sync`: its whole collection); `rollouts`: no batch collecting (rollout "
        "workers and engines waiting for the update)")
    staleness: dict[int, int] | None = described(
        "`rollout.mode=async`: transitions by how many updates their sampler was behind the learner", optional=True)
    stale_dropped: int | None = described(
        "`rollout.mode=async`: transitions left out, sampled more than `algorithm.max_staleness` updates behind "
        "(or by weights a learner restart gave up)", optional=True)
    loss: float | None = described("PPO-clip loss of the batch, averaged over its optimizer steps", optional=True)
    clip_frac: float | None = described("share of clipped tokens, averaged over the steps", optional=True)
    logprob_abs_diff: float | None = described(
        "mean \\|learner logprob − served logprob\\| on the same tokens before the update, at their calls' "
        "temperatures (≈1e-5 with vLLM: `benchmarks/results/lora_first_run.json`, `imitation_sql_pilot.json`; "
        "`learner.max_logprob_gap` bounds it on the first step); null where every call was a grammar's or drawn within "
        "a top_p nucleus (none to compare)", optional=True)
    entropy: float | None = described(
        "mean entropy of the sampling distribution over the trained tokens", optional=True)
    kl_ref: float | None = described(
        "KL to the initial policy per trained token (k1/k3; when `algorithm.kl_coef` > 0)", optional=True)
    value_loss: float | None = described(
        "PPO's critic loss, averaged over the optimizer steps (0 without a critic)", optional=True)
    tis_capped_frac: float | None = described(
        "share of tokens whose importance weight hit `algorithm.tis_cap`", optional=True)
    grad_norm: float | None = described("gradient norm before clipping", optional=True)
    steps: int | None = described(
        "optimizer steps the update took (`algorithm.mini_batches` × `algorithm.ppo_epochs`)", optional=True)
    skipped_nonfinite: int | None = described(
        "steps skipped, their loss or gradient not finite (all skipped: `updated` false)", optional=True)
    trained_tokens: int | None = described("tokens in the update", optional=True)
    micro_batches: int | None = described("micro-batches in the update, over every rank", optional=True)
    worker_digests: list[str] | None = described(
        "hash of each learner rank's parameters (ZeRO keeps them identical)", optional=True)
    learner_seconds: dict[str, float] | None = described(
        "rank 0's step: the update (`compute_s`: forward, backward and the optimizer, whose `optimizer_s` is "
        "within it), then `digest_s` and `publish_s` (weights to the registry)", optional=True)
    learner_peak_mib: float | None = described(
        "rank 0's peak memory so far, MiB: the GPU's allocated (CUDA), else the process's resident set", optional=True)
    served_policy_version: int | None = described("the version the endpoint serves after the sync", optional=True)
    probe_logprob_before: float | None = described(
        "greedy logprob of a fixed prompt through the API, before the sync (`algorithm.adapters`: the first "
        "adapter's)", optional=True)
    probe_logprob_after: float | None = described("the same, after the sync", optional=True)
    adapters: dict[str, dict[str, float]] | None = described(
        "`algorithm.adapters`: per adapter, the `transitions` it trains on, those `with_signal` (a nonzero "
        "advantage; ppo's come from the critic, in the learner), the mean final `reward` of their rollouts",
        optional=True)
    base_calls: int | None = described(
        "`algorithm.adapters`: the selected calls the base served (an agent no adapter names), left out",
        optional=True)
    eval_before: dict[str, Any] | None = described(
        "held-out evaluation before training (on iteration 0's line)", optional=True)
    eval: dict[str, Any] | None = described(
        "held-out evaluation `after` that many iterations, over `tasks` problems: `accuracy` (greedy), "
        "`reward_mean`, `failed_rollouts` (the platform's: no reward, counted wrong), `pass@k` and `mean@k` (one "
        "sample's accuracy at `rollout.temperature`) when `eval.pass_k` is set, `seconds` it took, `accuracy_by` "
        "each `task.balance` value's when that is set, `rollout_errors` as the iteration's when any failed",
        optional=True)


def iteration_record(iteration, rollouts, spans, transitions, adapted, sampling, version, results, seconds) -> dict:
    """The iteration's record from what it ran (rollouts, spans, transitions of every sampling round; the adapter's
    and dynamic sampling's counts; the learner ranks' replies, none without an update), for the trainer to add the
    sync's probe and the evaluations to; `line` makes it metrics.jsonl's line."""
    llm_spans = recorded_calls(spans)
    record = {
        "iteration": iteration,
        "reward_mean": sum(r.reward or 0.0 for r in rollouts) / len(rollouts),
        "rollouts": len(rollouts),
        "failed_rollouts": sum(r.status == "failed" for r in rollouts),
        "infra_failed_rollouts": adapted["infra_failed_rollouts"],
        "transitions": len(transitions),
        "policy_calls": adapted["policy_calls"],
        "unanswered_calls": adapted["unanswered_calls"],
        "truncation_rate": adapted["truncated_calls"] / max(adapted["policy_calls"], 1),
        "calls_across_updates": adapted["calls_across_updates"],
        "prefix_break_rate": adapted["prefix_breaks"] / max(adapted["call_joins"], 1),
        **sampling,  # sampling_rounds, groups_with_signal, groups_dropped
        "llm_spans": len(llm_spans),
        "unfaithfully_scored_calls": sum(not scored_faithfully(s) for s in llm_spans),
        "action_tokens_mean": adapted["action_tokens"] / len(rollouts),
        "response_diversity": response_diversity(transitions),
        "rollout_policy_versions": sorted({tr.policy_version for tr in transitions}),
        "policy_version": version,
        "updated": bool(results) and results[0]["updated"],
        "seconds": seconds,
    }
    if results:
        def mean(key: str) -> float | None:  # over the ranks that have one
            values = [r[key] for r in results if r[key] is not None]
            return sum(values) / len(values) if values else None

        record.update({
            "loss": sum(r["loss"] for r in results), "clip_frac": mean("clip_frac"),
            "logprob_abs_diff": mean("logprob_abs_diff"), "entropy": mean("entropy"), "kl_ref": mean("kl_ref"),
            "value_loss": sum(r["value_loss"] for r in results), "tis_capped_frac": mean("tis_capped"),
            "grad_norm": results[0]["grad_norm"], "steps": results[0]["steps"],
            "skipped_nonfinite": results[0]["skipped_nonfinite"], "trained_tokens": sum(r["tokens"] for r in results),
            "micro_batches": sum(r["micro_batches"] for r in results),
            "worker_digests": [r["digest"] for r in results],
            "learner_seconds": {k: round(results[0][k], 2) for k in ("compute_s", "optimizer_s", "publish_s",
                                                                     "digest_s")},
            "learner_peak_mib": round(results[0]["peak_mib"], 1),
        })
    if errors := common_errors(rollouts):
        record["rollout_errors"] = errors
    if "base_calls" in adapted:  # an adapter per agent
        record.update(adapters=per_adapter(transitions), base_calls=adapted["base_calls"])
    return record


def per_adapter(transitions) -> dict[str, dict[str, float]]:
    return {name: {"transitions": len(pool), "with_signal": sum(t.advantage != 0 for t in pool),
                   "reward": statistics.mean({t.rollout_id: t.reward for t in pool}.values())}
            for name, pool in sorted(by_adapter(transitions).items())}


_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")  # all but tab and line ends: the terminal's


def common_errors(rollouts, most: int = 3) -> dict[str, int]:
    """The failed rollouts' most common errors, each by its first and last lines (a traceback's frames differ where
    its cause, its last line, does not; a command's error opens with its exit status), with their counts."""
    def said(error: str | None) -> str:
        error = _CONTROL.sub("?", error or "no error said")  # an agent's stderr may hold the model's escape codes
        lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
        return (lines[0] if len(lines) == 1 else f"{lines[0][:150]} ... {lines[-1][:150]}")[:300]

    return dict(Counter(said(r.error) for r in rollouts if r.status == "failed").most_common(most))


def most_often(errors: dict[str, int], width: int = 160) -> str:
    """common_errors' errors in a line: "32x AgentCommandFailed: ...; 2x ..."."""
    return "; ".join(f"{n}x {error[:width]}" for error, n in errors.items())


def line(record: dict) -> dict:
    """The record as metrics.jsonl holds it, checked against IterationRecord: a field without a row in the docs'
    table fails here."""
    return IterationRecord.model_validate(record).model_dump(exclude_none=True)


def response_diversity(transitions) -> float:
    """Distinct responses per rollout within a task's group, averaged over groups: 1 when every rollout of a group
    answered differently; it falls towards 1 / group size as exploration collapses."""
    by_group: dict[str, dict[str, bytes]] = {}
    for tr in transitions:  # the responses' token ids as bytes: their dtype is fixed (types.Transition)
        episode = by_group.setdefault(tr.group_id, {})
        episode[tr.rollout_id] = episode.get(tr.rollout_id, b"") + tr.response_ids.tobytes()
    ratios = [len(set(episodes.values())) / len(episodes) for episodes in by_group.values()]
    return sum(ratios) / len(ratios) if ratios else 0.0


def summary(r: dict) -> str:
    """The iteration's line on the terminal."""
    update = (f"policy v{r['policy_version']} served" if r["updated"] else
              "steps skipped (not finite): policy unchanged" if r.get("skipped_nonfinite") else
              "signal all stale: policy unchanged" if r.get("stale_dropped") and r["groups_with_signal"] else
              "no signal: policy unchanged")
    held_out = f" | held-out {r['eval']['accuracy']:.3f}" if "eval" in r else ""
    rounds = f" ({r['sampling_rounds']} rounds)" if r["sampling_rounds"] > 1 else ""
    failed = (f"\n  {r['failed_rollouts']} of {r['rollouts']} rollouts failed, most often: "
              f"{most_often(r['rollout_errors'])}" if r.get("rollout_errors") else "")
    return (f"iter {r['iteration']}: reward {r['reward_mean']:.3f} | groups with signal {r['groups_with_signal']}"
            f"{rounds} | {update}{held_out} | " + " ".join(f"{k} {v:.1f}s" for k, v in r["seconds"].items()) +
            failed)


def fields_table() -> str:
    """docs/01-training.md's table of metrics.jsonl's fields."""
    rows = [f"| `{name}` | {field.description} |" for name, field in IterationRecord.model_fields.items()]
    return "\n".join(["| field | meaning |", "|---|---|", *rows])


if __name__ == "__main__":
    print(fields_table())
