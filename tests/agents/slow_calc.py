"""An agent given by entry point (task.agent=tests.agents.slow_calc:agent): the calc task's own agent, run once, then
held until the file its task names under "release" exists (120 s at most), then run again for the answer. A test
kills a worker while its rollouts are held, each with a policy call recorded, then lets the rollouts go on."""

import os
import time

from lightning_ray.tasks import calc


def agent(task: dict, base_url: str, model: str, api_key: str) -> str | None:
    calc.agent(task, base_url=base_url, model=model, api_key=api_key)
    deadline = time.monotonic() + 120
    while not os.path.exists(task["release"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return calc.agent(task, base_url=base_url, model=model, api_key=api_key)
