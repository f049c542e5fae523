"""An agent that ignores the base URL its rollout gives it (task.agent=tests.agents.own_url:agent): it calls the
policy server at its bare address, as one with the printed URL pasted in would. Its calls are recorded, under no
rollout: none is training data."""

from lightning_ray.tasks import calc


def agent(task: dict, base_url: str, model: str, api_key: str) -> str | None:
    return calc.agent(task, base_url=base_url.split("/rollouts/")[0] + "/v1", model=model, api_key=api_key)
