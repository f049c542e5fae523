"""The run's metrics as TensorBoard scalars (trainer.tensorboard): `tensorboard --logdir runs` draws every run's
curves side by side. A step is the iterations trained (0: before training)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from tensorboardX import SummaryWriter


def open_board(run_path: Path, first: int) -> SummaryWriter:
    """The run's writer, in <run_dir>/tensorboard, starting at iteration `first`: what a stopped run logged after
    the checkpoint a resumed run goes on from (or anything, in a run directory used again) is hidden."""
    # a file is named by the second it opens in: the suffix keeps a resumed run's apart from the stopped one's
    return SummaryWriter(str(run_path / "tensorboard"), purge_step=first + 1 if first else 0,
                         filename_suffix=f".iter-{first}")


def to_board(board: SummaryWriter, written: dict) -> None:
    """A metrics.jsonl line as scalars, nested keys joined by '/': the iteration's at the step after it, each held-out
    evaluation's as eval/<key> at the iterations it came after. Flushed: a run that dies keeps its curves."""
    step = written["iteration"] + 1
    for name, value in _numbers({k: v for k, v in written.items() if k not in ("iteration", "eval", "eval_before",
                                                                              "rollout_errors")}):  # text, not scalars
        board.add_scalar(name, value, step)
    for evaluation in filter(None, (written.get("eval_before"), written.get("eval"))):
        for name, value in _numbers({k: v for k, v in evaluation.items() if k not in ("after", "rollout_errors")},
                                    "eval/"):
            board.add_scalar(name, value, evaluation["after"])
    board.flush()


def _numbers(d: dict, prefix: str = "") -> Iterator[tuple[str, float]]:
    """The numbers in d (booleans as 0/1; lists and text left out), nested dicts' keys joined by '/'."""
    for key, value in d.items():
        if isinstance(value, dict):
            yield from _numbers(value, f"{prefix}{key}/")
        elif isinstance(value, (int, float)):
            yield f"{prefix}{key}", float(value)
