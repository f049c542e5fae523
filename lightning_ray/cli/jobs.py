"""The jobs as Hydra entry points (configs/train.yaml), shared by jobs/*.py and `lightning-ray train|eval|serve`.

Each reads its overrides from the command line as Hydra does (`key=value`, `--cfg job`, `hydra.run.dir=...`);
`run(job, overrides)` runs one with the overrides given instead."""

from __future__ import annotations

import json
import logging
import sys
import threading
from pathlib import Path

import hydra
from omegaconf import DictConfig

from lightning_ray.config import TrainConfig, from_hydra

CONFIGS = str(Path(__file__).resolve().parents[2] / "configs")  # the repository's (the package is installed editable)


def _quiet_http() -> None:
    for noisy in ("httpx", "httpx2"):  # one line per HTTP request drowns the progress lines
        logging.getLogger(noisy).setLevel(logging.WARNING)


@hydra.main(version_base=None, config_path=CONFIGS, config_name="train")
def train(raw: DictConfig) -> None:
    """Train the policy: evaluate, then iterations of rollouts → transitions → update → weight sync."""
    cfg = from_hydra(raw)
    from lightning_ray.trainer import train as train_policy  # imported late: `--help` and config errors stay instant

    _quiet_http()
    history = train_policy(cfg)
    print(f"done: {len(history)} iterations, metrics in {cfg.run_path / 'metrics.jsonl'}")


@hydra.main(version_base=None, config_path=CONFIGS, config_name="train")
def evaluate(raw: DictConfig) -> None:
    """Held-out accuracy (and pass@k) of model.path through the same server and agent as training."""
    cfg = from_hydra(raw)
    from lightning_ray.evaluation import evaluate as measure
    from lightning_ray.services import Services
    from lightning_ray.tasks import load_splits

    _quiet_http()
    with Services(cfg) as services:
        _, held_out = load_splits(cfg.task)
        result = {"model": str(services.model_path), "dataset": cfg.task.dataset, "protocol": cfg.task.protocol,
                  "eval_seed": cfg.task.eval_seed, **measure(services, held_out, cfg.eval.pass_k)}
    out = cfg.run_path / "eval.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    print(f"held-out accuracy {result['accuracy']:.3f} on {result['tasks']} problems; written to {out}")


@hydra.main(version_base=None, config_path=CONFIGS, config_name="train")
def serve(raw: DictConfig) -> None:
    """Serve model.path (the policy endpoint and the store API, calls recorded in the run directory) until Ctrl-C."""
    cfg = from_hydra(raw)
    from lightning_ray.services import Services

    _quiet_http()
    with Services(cfg, rollout_workers=False) as services:
        print(serving_help(services.server_url, cfg), flush=True)
        try:
            threading.Event().wait()  # until Ctrl-C (SIGINT)
        except KeyboardInterrupt:
            print("stopping ...", flush=True)
    print(f"stopped; the calls it served are recorded in {cfg.run_path}", flush=True)


def serving_help(url: str, cfg: TrainConfig) -> str:
    key = "$API_KEY" if cfg.serve.api_key else "EMPTY"
    auth = ' -H "Authorization: Bearer $API_KEY"' if cfg.serve.api_key else ""
    return f"""serving {cfg.model.path or 'the tiny test model'} as {cfg.model.name!r} at {url}/v1 (Ctrl-C stops)
  curl {url}/v1/chat/completions -H "Content-Type: application/json"{auth} \\
    -d '{{"model": "{cfg.model.name}", "messages": [{{"role": "user", "content": "What is 3 + 4?"}}]}}'
  python -c 'from openai import OpenAI; c = OpenAI(base_url="{url}/v1", api_key="{key}"); \\
print(c.chat.completions.create(model="{cfg.model.name}", messages=[{{"role": "user", "content": "Hi"}}]).choices[0].message.content)'"""


def run(job, overrides: list[str]) -> None:
    """Run a Hydra entry point above on these overrides, as if they were its command line."""
    argv, sys.argv = sys.argv, [sys.argv[0], *overrides]
    try:
        job()
    finally:
        sys.argv = argv
