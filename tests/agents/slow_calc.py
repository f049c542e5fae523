"""An agent given by entry point (task.agent=tests.agents.slow_calc:agent): the calc task's own agent, after a pause
that keeps each rollout running long enough for a test to kill its worker in the middle of it."""

import time

from lightning_ray.tasks import calc


def agent(task: dict, base_url: str, model: str, api_key: str) -> str | None:
    time.sleep(1.5)
    return calc.agent(task, base_url=base_url, model=model, api_key=api_key)
