"""The driver's side of training: one TorchTrainer.fit() in a thread, fed batches through Ray queues."""

from __future__ import annotations

import queue
import threading
from pathlib import Path

from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from ray.util.queue import Empty, Queue

from lightning_ray.config import TrainConfig
from lightning_ray.training.loop import train_loop_per_worker
from lightning_ray.types import Transition


class Learner:
    def __init__(self, cfg: TrainConfig, model_path: Path, registry):
        self.n = cfg.trainer.num_workers
        self.timeout_s = cfg.trainer.step_timeout_s
        self.inboxes = [Queue(actor_options={"num_cpus": 0}) for _ in range(self.n)]
        self.outbox = Queue(actor_options={"num_cpus": 0})
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={
                "model_path": str(model_path), "inboxes": self.inboxes, "outbox": self.outbox, "registry": registry,
                "lr": cfg.trainer.lr, "weight_decay": cfg.trainer.weight_decay, "grad_clip": cfg.trainer.grad_clip,
                "zero_stage": cfg.trainer.zero_stage, "clip_eps": cfg.algorithm.clip_eps,
                "extensions_dir": str(Path("~/.cache/lightning_ray/torch_extensions").expanduser()),
            },
            scaling_config=ScalingConfig(num_workers=self.n, use_gpu=False, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(name="learner", storage_path=str(cfg.run_path / "ray_train")),
        )
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._fit, args=(trainer,), daemon=True, name="learner-fit")
        self.thread.start()
        self.initial = self._gather()  # every rank built its DeepSpeed engine

    def _fit(self, trainer: TorchTrainer) -> None:
        try:
            trainer.fit()
        except BaseException as e:  # surfaced to the driver by _gather
            self.error = e

    def _gather(self) -> list[dict]:
        """One reply per rank, in rank order; fails fast if the training run died."""
        replies: list[dict] = []
        waited = 0.0
        while len(replies) < self.n:
            try:
                replies.append(self.outbox.get(timeout=1.0))
            except (Empty, queue.Empty):
                waited += 1.0
                if not self.thread.is_alive():
                    raise RuntimeError("the training run stopped") from self.error
                if waited > self.timeout_s:
                    raise TimeoutError(f"no reply from the training workers in trainer.step_timeout_s={self.timeout_s}s")
        return sorted(replies, key=lambda r: r["rank"])

    def step(self, transitions: list[Transition]) -> list[dict]:
        """One policy update over all transitions, sharded across ranks by length so work stays balanced."""
        ordered = sorted(transitions, key=lambda t: len(t.prompt_ids) + len(t.response_ids))
        for rank, inbox in enumerate(self.inboxes):
            inbox.put({"kind": "step", "transitions": ordered[rank :: self.n]})
        return self._gather()

    def save(self, path: Path) -> None:
        for inbox in self.inboxes:
            inbox.put({"kind": "save", "path": str(path)})
        self._gather()

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        self.thread.join(timeout=60)
