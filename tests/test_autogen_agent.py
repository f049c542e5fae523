"""An AutoGen agent, unchanged, against our endpoint — from AutoGen's own venv (its protobuf pin cannot share ours),
in a subprocess, as a Ray runtime_env per worker group would run it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import ray


ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venvs" / "autogen"


@pytest.fixture(scope="module")
def autogen_python() -> Path:
    """AutoGen's pinned venv (envs/autogen), built on first use (~15 s)."""
    python = VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-c", str(ROOT / "envs/autogen/constraints.txt"),
                        "autogen-agentchat", "autogen-ext[openai]"], check=True, timeout=600)
    return python


@pytest.fixture(scope="module")
def server(policy_app):
    with policy_app(defaults={"temperature": 0.0, "max_tokens": 48}) as app:
        yield app


def test_autogen_assistant_agent_runs_through_our_endpoint(autogen_python, server):
    rid = server["new_rollout"]()
    base_url = server["url"] + f"/rollouts/{rid}/attempts/at-1/v1"
    run = subprocess.run([str(autogen_python), str(ROOT / "tests/agents/autogen_calc.py"), base_url, "tiny-calc",
                          "Calculate 3 + 20."], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    messages = json.loads(run.stdout.strip().splitlines()[-1])
    assert messages[0] == {"type": "TextMessage", "content": "Calculate 3 + 20."} and len(messages) >= 2
    calls = server["store"].query_spans([rid])
    assert calls and all(c.attributes["lightning_ray.completion_token_ids"] for c in calls)
    # AutoGen sent its tools (its own schema) and the model's last reply is the agent's last message, unaltered
    assert calls[0].attributes["lightning_ray.request"]["tools"][0]["function"]["name"] == "calculator"
    assert messages[-1]["content"] == calls[-1].attributes["lightning_ray.response"]
