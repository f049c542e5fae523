"""The run's TensorBoard scalars (trainer/board.py), read back as TensorBoard reads the event files."""

from __future__ import annotations

import pytest
from helpers import board_scalars

from lightning_ray.trainer.board import open_board, to_board


def iteration(i: int, reward: float, evaluation: dict | None = None, **extra) -> dict:
    return {"iteration": i, "reward_mean": reward, "updated": True, "seconds": {"rollout": 2.0 + i},
            "rollout_policy_versions": [i], "adapters": {"write": {"reward": reward / 2}}, **extra,
            **({"eval": evaluation} if evaluation else {})}


def test_each_line_is_scalars_at_the_iterations_trained_and_evaluations_at_theirs(tmp_path):
    board = open_board(tmp_path, first=0)
    to_board(board, iteration(0, 0.25, eval_before={"after": 0, "accuracy": 0.5, "accuracy_by": {"add": 0.375}}))
    to_board(board, iteration(1, 0.5, {"after": 2, "accuracy": 0.75, "accuracy_by": {"add": 0.625}},
                              rollout_errors={"ValueError: no answer": 3}))
    board.close()
    scalars = board_scalars(tmp_path / "tensorboard")
    assert scalars["reward_mean"] == {1: 0.25, 2: 0.5}  # (float32: these are exact)
    assert scalars["eval/accuracy"] == {0: 0.5, 2: 0.75} and scalars["eval/accuracy_by/add"] == {0: 0.375, 2: 0.625}
    assert scalars["seconds/rollout"] == {1: 2.0, 2: 3.0} and scalars["adapters/write/reward"] == {1: 0.125, 2: 0.25}
    assert scalars["updated"] == {1: 1.0, 2: 1.0}
    assert not {"iteration", "rollout_policy_versions", "eval/after"} & set(scalars)  # a step, a list, a step
    assert not [name for name in scalars if name.startswith("rollout_errors")]  # texts: a series per error, once


def test_a_resumed_run_hides_what_the_stopped_one_logged_after_its_checkpoint(tmp_path):
    stopped = open_board(tmp_path, first=0)
    for i in range(3):  # its checkpoint after iteration 1; iteration 2 logged, then the run died
        to_board(stopped, iteration(i, 0.1 * i))
    stopped.close()
    resumed = open_board(tmp_path, first=2)  # goes on with iteration 2
    to_board(resumed, iteration(2, 0.9))
    resumed.close()
    assert board_scalars(tmp_path / "tensorboard")["reward_mean"] == pytest.approx({1: 0.0, 2: 0.1, 3: 0.9})


def test_an_error_counted_by_an_int_code_is_counted_not_raised():
    """The policy server counts an exception by its `code` when it has one: an int (an HTTP library's status) made
    Ray's counter raise TypeError inside the handler, in place of the error being answered."""
    from lightning_ray.metrics import count_error

    count_error("policy_server", 404)  # raised TypeError: Tag values must be str
