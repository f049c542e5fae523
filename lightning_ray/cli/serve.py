"""Serving a trained policy on its own (`lightning-ray serve`, jobs/serve.py)."""

from __future__ import annotations

import threading

from lightning_ray.config import TrainConfig, compose, job


@job("train")
def main(cfg: TrainConfig) -> None:
    """Serve model.path (the policy endpoint and the store API, every call recorded in the run directory) until
    Ctrl-C or SIGTERM."""
    from lightning_ray.services import Services
    from lightning_ray.terminal import route_logs

    route_logs(cfg.run_path / "logs", cfg.verbose)
    with Services(cfg, rollout_workers=False) as services:
        print(serving_help(services.server_url, cfg), flush=True)
        try:  # Ctrl-C, or SIGTERM (`kill`, a pod's stop: as Ctrl-C, services.py)
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


def app(args: dict):
    """The policy app for a Serve config (KubeRay's RayService: `import_path: jobs.serve:app`, `args: {overrides:
    [model.path=..., ...]}`): Serve runs it, so the cluster's Serve controller keeps it up. Its store shards and
    weight registry are detached actors (the builder's process ends once the app is built); calls are recorded in
    the run directory as with `serve`."""
    from lightning_ray.models import resolve_adapter, resolve_model_path
    from lightning_ray.placement import ON_HEAD
    from lightning_ray.serving.app import policy_app
    from lightning_ray.store.client import StoreClient
    from lightning_ray.weight_sync.registry import WeightRegistry

    cfg = compose(args.get("overrides", []))
    model_path = str(resolve_model_path(cfg.model))  # before the detached actors: a bad path leaves none behind
    adapter = resolve_adapter(cfg.model)
    cfg.run_path.mkdir(parents=True, exist_ok=True)
    cfg.save(cfg.run_path / "config.yaml")
    store = StoreClient.start(cfg.run_path, cfg.store.num_shards, actor_options={**ON_HEAD, "lifetime": "detached"})
    registry = WeightRegistry.options(lifetime="detached").remote()
    return policy_app(cfg, model_path, store, registry, adapter)
