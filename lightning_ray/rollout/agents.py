"""Which agent a rollout worker runs: the task's own, a Python entry point, or a command in any language.

Every form is called the same way, agent(task_input, base_url=..., model=..., api_key=...) -> answer, and knows
nothing of training: the base URL carries the rollout and attempt to the policy server, which records each call.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
from collections.abc import Callable

from lightning_ray.config import TaskConfig
from lightning_ray.rollout.runner import AttemptTimeout
from lightning_ray.tasks import load_task


def resolve_agent(cfg: TaskConfig, timeout_seconds: float | None = None) -> Callable:
    if cfg.command:
        return CommandAgent(cfg.command, timeout_seconds, cfg.agent_env)
    if cfg.agent:
        return entry_point(cfg.agent)
    return load_task(cfg.name).agent


def entry_point(spec: str) -> Callable:
    """"package.module:function" (the function may be an attribute path: "module:Class.method")."""
    module_name, _, attribute = spec.partition(":")
    try:
        target = importlib.import_module(module_name)
        for name in attribute.split("."):
            target = getattr(target, name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"task.agent={spec!r} cannot be loaded: {e}") from e
    if not callable(target):
        raise ValueError(f"task.agent={spec!r} is not callable")
    return target


class AgentCommandFailed(RuntimeError):
    """The agent's command exited with an error: the attempt fails (a score of 0, as an agent's exception does)."""


# What a command inherits from the worker's environment, which holds credentials it must not see (cloud keys,
# HF_TOKEN, ...): enough to run a program; task.agent_env names more.
AGENT_ENV = ("PATH", "HOME", "USER", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "PYTHONPATH")


class CommandAgent:
    """An agent in any language, run as a command once per rollout. It gets the endpoint the way the OpenAI SDKs
    read it (OPENAI_BASE_URL, OPENAI_API_KEY: its own attempt's key, plus OPENAI_MODEL) and the task's input as JSON
    on stdin (and in LIGHTNING_RAY_TASK); its answer is the last non-empty line it prints (earlier lines and stderr
    are its logs). Of the worker's environment it gets AGENT_ENV and the names in `env` only. At the attempt's
    deadline the process is killed, not abandoned."""

    def __init__(self, command: list[str], timeout_seconds: float | None = None, env: list[str] = ()):
        self.command, self.timeout_seconds, self.env = command, timeout_seconds, (*AGENT_ENV, *env)

    def __call__(self, task_input: dict, base_url: str, model: str, api_key: str) -> str:
        task = json.dumps(task_input)
        env = {**{k: os.environ[k] for k in self.env if k in os.environ}, "OPENAI_BASE_URL": base_url,
               "OPENAI_API_KEY": api_key, "OPENAI_MODEL": model, "LIGHTNING_RAY_TASK": task}
        try:
            run = subprocess.run(self.command, input=task, env=env, capture_output=True, text=True,
                                 timeout=self.timeout_seconds)
        except subprocess.TimeoutExpired as e:
            raise AttemptTimeout(f"the agent command ran past rollout.timeout_seconds={self.timeout_seconds:g} "
                                 "and was killed") from e
        if run.returncode != 0:
            raise AgentCommandFailed(f"{self.command[0]} exited with {run.returncode}: {run.stderr.strip()[-2000:]}")
        lines = [line for line in run.stdout.splitlines() if line.strip()]
        return lines[-1].strip() if lines else ""
