"""Serving a trained policy on its own (`lightning-ray serve`, jobs/serve.py)."""

from __future__ import annotations

import signal
import threading

import hydra
from omegaconf import DictConfig

from lightning_ray.cli.common import CONFIGS, quiet_http
from lightning_ray.config import TrainConfig, from_hydra


@hydra.main(version_base=None, config_path=CONFIGS, config_name="train")
def main(raw: DictConfig) -> None:
    """Serve model.path (the policy endpoint and the store API, every call recorded in the run directory) until
    Ctrl-C or SIGTERM."""
    cfg = from_hydra(raw)
    from lightning_ray.services import Services

    quiet_http()
    with Services(cfg, rollout_workers=False) as services:
        print(serving_help(services.server_url, cfg), flush=True)
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill`, a pod's stop: as Ctrl-C, cleanly
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            print("stopping ...", flush=True)
    print(f"stopped; the calls it served are recorded in {cfg.run_path}", flush=True)


def serving_help(url: str, cfg: TrainConfig) -> str:
    """Where the policy is and how to call it: with curl, and with the openai client."""
    key = "<serve.api_key>" if cfg.serve.api_key else "EMPTY"  # the key itself is not printed
    auth = f' -H "Authorization: Bearer {key}"' if cfg.serve.api_key else ""
    messages = '[{"role": "user", "content": "What is 3 + 4?"}]'
    return f"""serving {cfg.model.path or 'the tiny test model'} as {cfg.model.name!r} at {url}/v1 (Ctrl-C stops)
  curl {url}/v1/chat/completions -H "Content-Type: application/json"{auth} \\
    -d '{{"model": "{cfg.model.name}", "messages": {messages}}}'
  # Python
  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1", api_key="{key}")
  print(client.chat.completions.create(model="{cfg.model.name}", messages={messages}).choices[0].message.content)"""
