"""The AutoGen example agent, after checking where it runs: in the runtime_env Ray built for it (protobuf 5, which
the trainer's own environment cannot hold). A worker in the wrong environment fails every rollout."""

from importlib.metadata import version


def agent(task: dict, base_url: str, model: str, api_key: str) -> str | None:
    if not version("protobuf").startswith("5."):
        raise RuntimeError(f"AutoGen's agent runs with protobuf {version('protobuf')}, not its own runtime_env's")
    from examples.autogen_calc.agent import agent as autogen_agent

    return autogen_agent(task, base_url=base_url, model=model, api_key=api_key)
