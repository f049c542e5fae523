"""What the RL loop carries from step to step and from iteration to iteration, and a checkpoint keeps: the run's
settings and services, the task splits and the sampler drawing from them, the records and evaluations so far."""

from __future__ import annotations

import random
import time
from contextlib import contextmanager

from lightning_ray.algorithm.select import Selection
from lightning_ray.config import TrainConfig
from lightning_ray.learner.checkpoint import Checkpoint, LoopState
from lightning_ray.services import Services
from lightning_ray.tasks import load_splits
from lightning_ray.trainer.board import open_board
from lightning_ray.types import Task


class Run:
    def __init__(self, cfg: TrainConfig, services: Services, resume: Checkpoint | None,
                 splits: tuple[list[Task], list[Task]] | None = None):
        """`splits`: the training and held-out tasks (made here if not given: tasks.load_splits)."""
        self.cfg, self.services, self.learner = cfg, services, services.learner
        self.train_tasks, self.held_out = splits or load_splits(cfg.task)
        self.rng = random.Random(cfg.seed)  # the task sampler
        self.select = Selection.of(cfg.model.name, cfg.algorithm.select.models, cfg.algorithm.select.agents)
        self.history: list[dict] = []  # metrics.jsonl's lines
        self.evals: list[dict] = []  # held-out evaluations, each with the iterations it came "after"
        self.started: list[float] = []  # when each iteration's collection started (span retention cuts there)
        self.sampler_before: dict[int, tuple] = {}  # the sampler's state before each iteration's tasks were drawn
        self.first = 0
        if resume:  # as the stopped run stood after its checkpoint's iteration
            state = resume.state
            self.history, self.evals, self.started, self.first = (state.history, state.evals, state.started,
                                                                  state.next_iteration)
            self.rng.setstate(state.random_state())
        self.deadline = float("inf")
        self.phase = PhaseTimer()
        self.probe: dict | None = None  # the fixed prompt's served logprobs, as of the last sync
        self.board = open_board(cfg.run_path, self.first) if cfg.trainer.tensorboard else None  # closed by finish

    def iterations(self) -> range:
        """The iterations still to run."""
        return range(self.first, self.cfg.trainer.iterations)

    def start_clock(self) -> None:
        """trainer.max_minutes counts from here: the held-out evaluation before training is not in the budget."""
        if minutes := self.cfg.trainer.max_minutes:
            self.deadline = time.monotonic() + 60 * minutes

    def ends_at(self, iteration: int) -> bool:
        """Whether this iteration is the run's last: the number of iterations reached or the time budget spent
        (asked once its batch is in)."""
        return iteration + 1 == self.cfg.trainer.iterations or time.monotonic() >= self.deadline

    def evaluates_at(self, iteration: int, last: bool) -> bool:
        every = self.cfg.trainer.eval_every
        return bool(every) and ((iteration + 1) % every == 0 or last)

    def checkpoints_at(self, iteration: int, last: bool) -> bool:
        return (iteration + 1) % self.cfg.trainer.checkpoint_every == 0 or last

    def state(self, iteration: int) -> LoopState:
        """After `iteration`. Batches collected ahead of it (async) are not in it: the sampler is kept as it stood
        before their tasks were drawn, so a resumed run draws those tasks again and collects them anew."""
        return LoopState(next_iteration=iteration + 1, policy_version=self.learner.version,
                         rng_state=self.sampler_before.get(iteration + 1, self.rng.getstate()), evals=self.evals,
                         started=self.started[:iteration + 1], history=self.history)


class PhaseTimer:
    """Seconds per phase of an iteration (rollout, adapt, train, sync, eval, checkpoint), summed over rounds."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = round(self.seconds.get(name, 0.0) + seconds, 3)
