"""Held-out evaluation (`lightning-ray eval`, jobs/eval.py)."""

from __future__ import annotations

import json

from lightning_ray.config import TrainConfig, job


@job("train")
def main(cfg: TrainConfig) -> None:
    """Held-out accuracy (and pass@k) of model.path through the same server and agent as training."""
    from lightning_ray.services import Services  # imported late: `--help` and config errors stay instant
    from lightning_ray.tasks import dataset_of, load_splits
    from lightning_ray.terminal import route_logs
    from lightning_ray.trainer.evaluate import evaluate, failures

    _, held_out = load_splits(cfg.task)  # a task setting its task refuses, before the services' minutes of start
    route_logs(cfg.run_path / "logs", cfg.verbose)
    with Services(cfg) as services:
        result = {"model": str(services.model_path), "dataset": dataset_of(cfg.task), "protocol": cfg.task.protocol,
                  "eval_seed": cfg.task.eval_seed, **evaluate(services, held_out, cfg.eval.pass_k)}
    out = cfg.run_path / "eval.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    print(f"held-out accuracy {result['accuracy']:.3f} on {result['tasks']} problems{failures(result)}; written to "
          f"{out}")
