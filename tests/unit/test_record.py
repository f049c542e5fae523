"""metrics.jsonl's line is a typed record whose field descriptions are the docs' table: a field the trainer writes
without a row there fails, and the docs cannot drift from what the code writes."""

from __future__ import annotations

from collections import Counter

import pytest
from helpers import ROOT
from pydantic import ValidationError

from lightning_ray.trainer.record import IterationRecord, fields_table, iteration_record, line, summary
from lightning_ray.types import Rollout, Task, Transition

ADAPTED = Counter(infra_failed_rollouts=1, policy_calls=4, unanswered_calls=0, truncated_calls=1, prefix_breaks=0,
                  call_joins=2, action_tokens=7)
SAMPLING = {"sampling_rounds": 1, "groups_with_signal": 1, "groups_dropped": 0}
REPLY = {"rank": 0, "updated": True, "loss": 0.5, "clip_frac": 0.1, "logprob_abs_diff": 1e-7, "entropy": 1.2,
         "kl_ref": 0.0, "value_loss": 0.0, "tis_capped": 0.0, "grad_norm": 0.3, "steps": 1, "skipped_nonfinite": 0,
         "tokens": 12, "micro_batches": 2, "digest": "ab12", "compute_s": 0.5, "optimizer_s": 0.1, "publish_s": 0.2,
         "digest_s": 0.01, "peak_mib": 812.5}


def made(results: list[dict]) -> dict:
    rollouts = [Rollout(rollout_id=f"r{i}", task=Task(task_id="t", input={}), status="succeeded", reward=float(i))
                for i in range(2)]
    transitions = [Transition(rollout_id=r.rollout_id, group_id="g", span_id=f"s{i}", prompt_ids=[1],
                              response_ids=[2 + i], logprobs=[-1.0], reward=r.reward, policy_version=3)
                   for i, r in enumerate(rollouts)]
    return iteration_record(0, rollouts, [], transitions, ADAPTED, SAMPLING, 4, results, {"rollout": 1.5})


def test_the_docs_table_is_the_records_field_descriptions():
    """docs/01-training.md shows `python -m lightning_ray.trainer.record`'s table as it is."""
    assert fields_table() in (ROOT / "docs" / "01-training.md").read_text()


@pytest.mark.parametrize("results", [[], [REPLY, {**REPLY, "rank": 1, "digest": "ab12"}]], ids=["no update", "update"])
def test_every_field_the_trainer_writes_has_a_row(results):
    record = made(results)
    # what trainer/log.py adds: the evaluation, the idle times, async mode's staleness
    record.update({"eval": {"after": 1, "tasks": 4, "accuracy": 0.5}, "idle_seconds": {"learner": 1.5, "rollouts": 0.5},
                   "staleness": {0: 1, 1: 1}, "stale_dropped": 0})
    written = line(record)
    assert written == record  # nothing dropped, nothing renamed
    assert set(written) <= set(IterationRecord.model_fields)
    assert ("loss" in written) == bool(results) and written["response_diversity"] == 1.0
    assert summary(written).startswith("iter 0: reward 0.500 | groups with signal 1 | ")


def test_a_field_without_a_row_is_refused():
    with pytest.raises(ValidationError, match="new_metric"):
        line({**made([]), "new_metric": 1})


def test_per_adapter_counts_and_rollout_rewards():
    """algorithm.adapters: each adapter's transitions, those with a signal, and the mean reward of the rollouts they
    come from, each rollout once however many of its calls the adapter served."""
    rollouts = [Rollout(rollout_id=f"r{i}", task=Task(task_id="t", input={}), status="succeeded", reward=float(i))
                for i in range(2)]
    served = [("r0", "draft", 0.5), ("r0", "draft", 0.5), ("r1", "draft", 0.0), ("r1", "solve", -1.0)]
    transitions = [Transition(rollout_id=rid, group_id="g", span_id=f"s{i}", prompt_ids=[1], response_ids=[2],
                              logprobs=[-1.0], reward=float(rid[1]), advantage=adv, policy_version=3, adapter=adapter)
                   for i, (rid, adapter, adv) in enumerate(served)]
    record = iteration_record(0, rollouts, [], transitions, Counter({**ADAPTED, "base_calls": 2}), SAMPLING, 4, [],
                              {"rollout": 1.5})
    assert record["adapters"] == {"draft": {"transitions": 3, "with_signal": 2, "reward": 0.5},
                                        "solve": {"transitions": 1, "with_signal": 1, "reward": 1.0}}
    assert record["base_calls"] == 2
    assert "adapters" not in made([])  # one policy: no per-adapter split


def test_failures_and_lengths_count_each_rollout_once_and_every_call():
    """Failures, the platform's among them; the response length counts the adapter's calls before any is left out
    (the overlong filter dropped the longest, and the curve fell as truncation rose)."""
    crash = "Traceback (most recent call last):\n  File \"agent.py\", line 9, in solve\n\nKeyError: 'answer'\n"
    rollouts = [Rollout(rollout_id="ok", task=Task(task_id="t", input={}), status="succeeded", reward=1.0),
                *(Rollout(rollout_id=f"crash{i}", task=Task(task_id="t", input={}), status="failed", reward=0.0,
                          error=crash) for i in range(2)),
                Rollout(rollout_id="down", task=Task(task_id="t", input={}), status="failed", reward=None)]
    record = iteration_record(0, rollouts, [], [], ADAPTED, SAMPLING, 4, [], {})
    assert (record["failed_rollouts"], record["infra_failed_rollouts"]) == (3, 1)
    # what they said, on the terminal too: each error by its first and last lines (a traceback's cause is its last),
    # the most common first
    said = "Traceback (most recent call last): ... KeyError: 'answer'"
    assert record["rollout_errors"] == {said: 2, "no error said": 1}
    assert summary(record).endswith(f"\n  3 of 4 rollouts failed, most often: 2x {said}; 1x no error said")
    assert "rollout_errors" not in made([])  # none failed
    assert record["action_tokens_mean"] == pytest.approx(7 / 4)


def test_the_reports_seconds_count_an_async_batchs_collection_once():
    """rollout.mode=async: a batch's rollout and adapt ran while the update before it trained; its line's `wait` is
    what the loop waited for them. Summed with them, the report doubled an async run's time."""
    from lightning_ray.report import loop_seconds

    sync = {"seconds": {"rollout": 60.0, "adapt": 5.0, "train": 55.0, "sync": 2.0}}
    overlapped = {"seconds": {"rollout": 60.0, "adapt": 5.0, "wait": 10.0, "train": 55.0, "sync": 2.0}}
    assert (loop_seconds(sync), loop_seconds(overlapped)) == (122.0, 67.0)


def test_an_error_printed_on_the_terminal_carries_no_escape_codes():
    """A command agent's stderr may hold the model's text: ESC sequences (clear the screen, OSC 52 writes to the
    clipboard) reached the terminal through the iteration's line."""
    error = "exit status 1\nboom \x1b[2J\x1b[H\x1b]52;c;aGk=\x1b\\ \x9b31m done\ttab"
    rollouts = [Rollout(rollout_id="r", task=Task(task_id="t", input={}), status="failed", reward=0.0, error=error)]
    (said,) = iteration_record(0, rollouts, [], [], ADAPTED, SAMPLING, 4, [], {})["rollout_errors"]
    assert said == "exit status 1 ... boom ?[2J?[H?]52;c;aGk=?\\ ?31m done\ttab"
