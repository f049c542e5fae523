"""An agent given by entry point (task.agent=tests.agents.hang_calc:agent): every other rollout a worker process runs
hangs for an hour, as an agent stuck in a loop would; the others run the calc task's own agent."""

import itertools
import time

from lightning_ray.tasks import calc

_calls = itertools.count()


def agent(task: dict, base_url: str, model: str, api_key: str) -> str | None:
    if next(_calls) % 2:
        time.sleep(3600)
    return calc.agent(task, base_url=base_url, model=model, api_key=api_key)
