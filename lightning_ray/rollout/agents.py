"""Which agent a rollout worker runs: the task's own, a Python entry point, or a command in any language.

Every form is called the same way, agent(task_input, base_url=..., model=..., api_key=...) -> answer, and knows
nothing of training: the base URL carries the rollout and attempt to the policy server, which records each call.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable

from lightning_ray.config import TaskConfig
from lightning_ray.rollout.runner import LEASE_LOST, AttemptTimeout, PlatformFailure
from lightning_ray.tasks import load_task


def resolve_agent(cfg: TaskConfig, timeout_seconds: float | None = None) -> Callable:
    if cfg.command:
        return CommandAgent(cfg.command, timeout_seconds, cfg.agent_env)
    if cfg.agent:
        return entry_point(cfg.agent)
    if not callable(agent := getattr(load_task(cfg.name), "agent", None)):
        raise ValueError(f"task.name={cfg.name}: the task has no agent of its own: give task.agent or task.command")
    return agent


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


class AgentCommandFailedByPlatform(PlatformFailure):
    """The command could not start, was killed (SIGKILL: the out-of-memory killer), exited with EX_TEMPFAIL (75: its
    way to say the platform failed it), or died of an OpenAI SDK's error for an endpoint unreachable or answering 5xx,
    as an agent in the worker's process would have raised: no reward, the attempt retried."""


EX_TEMPFAIL = 75
# What an OpenAI SDK (Python, JavaScript) raises where it could not reach the endpoint, got a 5xx, or was set up
# wrong (runner.INFRASTRUCTURE_ERRORS), as its uncaught error's line says it (the error's name at the line's start);
# looked for in stderr's last lines only (the rest is the agent's log, which may hold anything, the model's words too)
SDK_PLATFORM_ERRORS = re.compile(r"^(?:[\w.]+\.)?(?:APIConnectionError|APIConnectionTimeoutError|InternalServerError"
                                 r"|AuthenticationError|PermissionDeniedError|NotFoundError)\b"
                                 r"|^Error: connect ECONN(?:REFUSED|RESET)\b", re.MULTILINE)
LAST_WORDS = 20  # lines: a JavaScript error's stack follows its line
# A task's JSON in LIGHTNING_RAY_TASK up to this size: Linux refuses an environment string past 128 KiB (stdin has it)
MAX_TASK_ENV = 100_000


# What a command inherits from the worker's environment, which holds credentials it must not see (cloud keys,
# HF_TOKEN, ...): enough to run a program; task.agent_env names more.
AGENT_ENV = ("PATH", "HOME", "USER", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "PYTHONPATH")


class CommandAgent:
    """An agent in any language, run as a command once per rollout. It gets the endpoint the way the OpenAI SDKs
    read it (OPENAI_BASE_URL, OPENAI_API_KEY: its own attempt's key, plus OPENAI_MODEL) and the task's input as JSON
    on stdin (and in LIGHTNING_RAY_TASK); its answer is the last non-empty line it prints (earlier lines and stderr
    are its logs). Of the worker's environment it gets AGENT_ENV and the names in `env` only. At the attempt's
    deadline its process group is killed, not abandoned; so is what it left running when it exits."""

    def __init__(self, command: list[str], timeout_seconds: float | None = None, env: list[str] = ()):
        self.command, self.timeout_seconds, self.env = command, timeout_seconds, (*AGENT_ENV, *env)

    def __call__(self, task_input: dict, base_url: str, model: str, api_key: str) -> str:
        task = json.dumps(task_input)
        env = {**{k: os.environ[k] for k in self.env if k in os.environ}, "OPENAI_BASE_URL": base_url,
               "OPENAI_API_KEY": api_key, "OPENAI_MODEL": model,
               **({"LIGHTNING_RAY_TASK": task} if len(task) <= MAX_TASK_ENV else {})}
        try:  # a session of its own: at the deadline the whole group goes (a launcher's child too: sh -c, npx, uv run)
            process = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, env=env, text=True, start_new_session=True)
        except OSError as e:
            raise AgentCommandFailedByPlatform(f"task.command {self.command} could not start: {e}") from e
        RUNNING.add(process.pid)
        try:
            stdout, stderr = self._communicate(process, task)
        finally:
            kill_group(process.pid)  # what it left running
            RUNNING.discard(process.pid)
        if process.returncode != 0:
            said = f"{self.command[0]} exited with {process.returncode}: {stderr.strip()[-2000:]}"
            last_words = "\n".join(stderr.strip().splitlines()[-LAST_WORDS:])
            platform = process.returncode in (-signal.SIGKILL, EX_TEMPFAIL) or SDK_PLATFORM_ERRORS.search(last_words)
            raise (AgentCommandFailedByPlatform if platform else AgentCommandFailed)(said)
        lines = [line for line in stdout.splitlines() if line.strip()]
        return lines[-1].strip() if lines else ""

    def _communicate(self, process: subprocess.Popen, task: str) -> tuple[str, str]:
        """Its output once it exits; killed at the deadline, or once the attempt's lease is lost (runner.LEASE_LOST,
        looked at every second: its rollout cancelled or timed out, its result would be dropped)."""
        lost, start, given = LEASE_LOST.get(), time.monotonic(), task
        while True:
            left = None if self.timeout_seconds is None else max(self.timeout_seconds - (time.monotonic() - start), 0)
            wait = left if lost is None else min(left, 1.0) if left is not None else 1.0
            try:  # called again after a timeout, it goes on where it was (its input is given once)
                return process.communicate(given, timeout=wait)
            except subprocess.TimeoutExpired as e:
                given = None
                late, gone = left is not None and wait >= left, lost is not None and lost.is_set()
                if late or gone:
                    kill_group(process.pid)
                    process.communicate()
                    if late:
                        raise AttemptTimeout(f"the agent command ran past rollout.timeout_seconds="
                                             f"{self.timeout_seconds:g} and was killed") from e
                    raise AgentCommandFailedByPlatform("the attempt's lease was lost (its rollout cancelled or timed "
                                                       "out in the store): the command was killed") from e


def kill_group(pgid: int) -> None:
    """A command's whole process group (its pid's): what it started in the background too, so no agent outlives its
    attempt calling the policy."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:  # every process of the group has exited
        pass


# The process groups of the commands running in this process: killed when the run stops (the worker's own death
# takes its direct children only, and a command runs in a session of its own: its launcher's children lived on)
RUNNING: set[int] = set()


def kill_running() -> int:
    """Kill every command agent still running here, with all it started; how many."""
    groups = list(RUNNING)
    for pgid in groups:
        kill_group(pgid)
    return len(groups)
