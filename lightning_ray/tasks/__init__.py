"""Built-in tasks. Each module offers make_tasks(n, seed), agent(task, base_url, model, api_key) and
reward(task, answer)."""

import importlib
from types import ModuleType


def load_task(name: str) -> ModuleType:
    return importlib.import_module(f"lightning_ray.tasks.{name}")
