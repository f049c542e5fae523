"""Rollout workers host any agent: a Python entry point, or a command in any language (a JavaScript agent using the
official `openai` npm package); and they survive a crash: a worker killed in the middle of a rollout costs an
attempt, never a lost or duplicated transition. Real Ray, Serve, the HF engine on the tiny model, SQLite, Node."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import ray

from lightning_ray.algorithm.lightningrl import adapt, recorded_calls
from lightning_ray.config import TaskConfig
from lightning_ray.models.tiny import EASY
from lightning_ray.rollout.agents import AGENT_ENV, CommandAgent, resolve_agent
from lightning_ray.services import Services
from lightning_ray.tasks import load_splits
from lightning_ray.trainer import train

from helpers import ROOT, small

NODE_AGENT = ROOT / "examples" / "node_calc"


def config(tmp_path, serve_port, tiny_model_path, **overrides) -> dict:
    return {"run_dir": str(tmp_path), "model": {"path": str(tiny_model_path)}, "serve": {"port": serve_port},
            "task": {"generator": EASY, "eval_size": 4, **overrides.pop("task", {})}, **overrides}


def test_a_run_that_fails_to_start_stops_what_it_started(ray_cluster, tiny_model_path, serve_port, tmp_path):
    """The rollout workers start beside the policy app and the learner's ranks: an agent that cannot be imported
    fails the start, naming it and the part that was starting, and takes the app and the learner down with it."""
    from ray import serve

    def reserved() -> set[str]:  # placement groups holding resources: Ray Train's, while its ranks live
        return {pg for pg, t in ray.util.placement_group_table().items() if t["state"] != "REMOVED"}

    before = reserved()
    cfg = small(config(tmp_path, serve_port, tiny_model_path, task={"agent": "tests.agents.no_such_agent:agent"}))
    with pytest.raises(Exception, match="no_such_agent") as failed:
        Services(cfg, learner=True)
    assert failed.value.__notes__ == [
        "while starting the policy server (hf engine) and the rollout workers (what had started is stopped)"]
    assert "policy" not in serve.status().applications
    deadline = time.monotonic() + 60
    while reserved() - before:
        assert time.monotonic() < deadline, "the learner's ranks outlived the failed start"
        time.sleep(0.5)


def test_a_second_run_on_a_cluster_where_one_runs_is_refused(ray_cluster, tiny_model_path, serve_port, tmp_path):
    """Serve's apps are the cluster's: a second job submitted to it replaced the running one's policy server (whose
    weight syncs then waited for ever), and whichever ended first deleted both. A run lives while its registry does."""
    from ray import serve

    from lightning_ray.config import ConfigError

    @ray.remote(num_cpus=0)
    class Registry:  # a stand-in for the other run's weight registry: only its name is looked at
        pass

    other = Registry.options(name="weight-registry@another-run").remote()
    try:
        with pytest.raises(ConfigError, match=r"ray.address: another run \(another-run\) is running on this Ray"):
            Services(small(config(tmp_path, serve_port, tiny_model_path)))
        assert "policy" not in serve.status().applications
    finally:
        ray.kill(other)


def test_a_run_whose_first_round_has_no_policy_call_stops_saying_why(ray_cluster, tiny_model_path, serve_port,
                                                                       tmp_path):
    """An agent that calls a URL of its own (the printed one pasted in; a selection that picks none of its calls
    likewise): the run trained nothing to its end, each line saying "no signal"."""
    from lightning_ray.trainer.collect import NoPolicyCalls

    cfg = small(config(tmp_path, serve_port, tiny_model_path, task={"agent": "tests.agents.own_url:agent"},
                       trainer={"iterations": 3, "eval_every": 0}))
    with pytest.raises(NoPolicyCalls, match=r"no rollout of iteration 0 \(16\) made a call the policy can be trained "
                                            r"on, so the run stops: none reached the policy server under its rollout: "
                                            r"does the agent use the base URL it is given"):
        train(cfg)


def test_agents_left_behind_at_timeouts_cost_their_worker_a_restart_not_a_leak(ray_cluster, tiny_model_path,
                                                                                serve_port, tmp_path):
    """Every other rollout hangs past rollout.timeout_seconds: its thread cannot be stopped and is left behind. At
    max_abandoned_agents the worker takes no more rollouts and is restarted once its own have ended, so over many
    rounds the threads it holds stay bounded and every rollout ends (the hung ones timed out: failed, scored 0). The
    timeout is ten times what a rollout that does not hang takes here (~0.5 s), so a loaded machine cannot time one
    of those out too (at 1 s, one did: a CI run with other work beside it)."""
    cfg = small(config(tmp_path, serve_port, tiny_model_path, task={"agent": "tests.agents.hang_calc:agent"},
                       rollout={"num_workers": 1, "agents_per_worker": 2, "timeout_seconds": 5.0,
                                "max_abandoned_agents": 2}))
    with Services(cfg) as services:
        [worker], tasks = services.workers, load_splits(cfg.task)[0][:4]
        pids, threads, ended = set(), [], []
        for round_ in range(3):
            ended += services.run_rollouts(tasks, f"round {round_}")
            pids.add(ray.get(worker.__ray_call__.remote(lambda self: os.getpid())))
            threads.append(ray.get(worker.__ray_call__.remote(lambda self: threading.active_count())))
    hung = [r for r in ended if r.status != "succeeded"]  # the 2nd and 4th of each round, in a fresh process
    assert len(ended) == 12 and len(hung) == 6
    assert all(r.status == "failed" and r.reward == 0.0 and "timeout" in r.error for r in hung)  # the policy's
    assert len(pids) > 1, "the worker was never restarted"
    assert max(threads) <= min(threads) + 2, threads  # the abandoned threads went with the old processes


def test_a_worker_killed_mid_rollout_costs_an_attempt_not_a_transition(ray_cluster, tiny_model_path, serve_port,
                                                                        tmp_path):
    cfg = small(config(tmp_path, serve_port, tiny_model_path, task={"agent": "tests.agents.slow_calc:agent"},
                       rollout={"num_workers": 2, "agents_per_worker": 2, "max_attempts": 2,
                                "unresponsive_seconds": 6}))  # beats every 2 s: a late one costs no attempt
    release = tmp_path / "release"  # the agents wait for it after a first call (tests/agents/slow_calc.py)
    with Services(cfg) as services:
        tasks = [t.model_copy(update={"input": {**t.input, "release": str(release)}})
                 for t in load_splits(cfg.task)[0][:8]]
        result: dict = {}
        runner = threading.Thread(target=lambda: result.update(rollouts=services.run_rollouts(tasks, "rollouts")))
        runner.start()

        def wait_until(done, what: str) -> None:
            deadline = time.monotonic() + 60
            while not done():
                assert time.monotonic() < deadline, f"waited 60 s for {what}"
                time.sleep(0.2)

        def mid_rollout() -> list:  # running attempts with a policy call recorded, held by their agent
            called = {s.attempt_id for s in recorded_calls(services.store.query_spans())}
            return [a for r in services.store.query_rollouts(status=["running"])
                    for a in services.store.get_attempts(r.rollout_id)
                    if a.status == "running" and a.attempt_id in called]

        wait_until(mid_rollout, "an attempt with a policy call")
        victim = mid_rollout()[0]  # kill the worker that runs it
        worker = next(w for w in services.workers if w._actor_id.hex() == victim.worker_id)
        ray.kill(worker, no_restart=False)  # a crash: Ray restarts the actor, its attempts are lost with it
        killed = lambda: services.store.get_attempts(victim.rollout_id)[0]  # noqa: E731
        wait_until(lambda: killed().status != "running", "the killed attempt's lease to run out")
        assert killed().attempt_id == victim.attempt_id and killed().status == "unresponsive"
        release.touch()
        runner.join(timeout=180)
        assert not runner.is_alive()
        rollouts = result["rollouts"]
        spans = services.store.query_spans([r.rollout_id for r in rollouts])
    assert all(r.status == "succeeded" and r.reward is not None for r in rollouts)
    assert any(s.attempt_id == victim.attempt_id for s in recorded_calls(spans))  # the killed attempt's calls
    retried = next(r for r in rollouts if r.rollout_id == victim.rollout_id)
    assert retried.attempts == 2 and retried.attempt_id != victim.attempt_id
    transitions, _ = adapt(rollouts, spans, cfg.model.name)
    # every transition is a call of a rollout's final attempt, once; the killed attempt's calls are left out
    final = {r.attempt_id for r in rollouts}
    calls = [s for s in recorded_calls(spans) if s.attempt_id in final]
    assert sorted(t.span_id for t in transitions) == sorted(s.span_id for s in calls)
    assert max(Counter((t.rollout_id, t.span_id) for t in transitions).values()) == 1
    assert {t.rollout_id for t in transitions} == {r.rollout_id for r in rollouts}


@pytest.fixture(scope="module")
def node_agent() -> list[str]:
    """The JavaScript agent's pinned dependencies (package-lock.json), installed from the npm registry once."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("needs Node.js and npm (runs wherever they are installed)")
    if not (NODE_AGENT / "node_modules" / "openai").exists():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=NODE_AGENT, check=True, timeout=300,
                       capture_output=True)
    return ["node", str(NODE_AGENT / "calc.mjs")]


def test_a_javascript_agent_trains_like_any_other(node_agent, ray_cluster, tiny_model_path, serve_port, tmp_path):
    cfg = small(config(tmp_path, serve_port, tiny_model_path, task={"command": node_agent},
                       rollout={"tasks_per_iteration": 8, "group_size": 4, "agents_per_worker": 4},
                       trainer={"iterations": 1, "eval_every": 0}, learner={"lr": 1e-3}))
    [h] = train(cfg)  # its calls were recorded by the server and became transitions; no rollout failed
    assert h["rollouts"] == 32 and h["failed_rollouts"] == 0 and h["transitions"] == h["llm_spans"] > 0
    assert h["reward_mean"] > 0  # the tiny model solves some of these through the JS agent's calculator
    assert h["updated"]  # 8 groups of 4 at temperature 1: all of them without a learning signal is vanishingly rare


def test_a_command_gets_the_endpoint_and_task_and_its_failures_are_the_attempts(tmp_path):
    script = tmp_path / "agent.py"
    script.write_text("import json, os, sys\ntask = json.load(sys.stdin)\nprint('log line')\n"
                      "print(os.environ['OPENAI_BASE_URL'], os.environ['OPENAI_MODEL'], task['question'])\n"
                      "sys.exit(task.get('exit', 0))\n")
    agent = CommandAgent(["python3", str(script)], timeout_seconds=30)
    assert agent({"question": "2+2"}, base_url="http://x/v1", model="policy", api_key="k") == "http://x/v1 policy 2+2"
    with pytest.raises(RuntimeError, match="exited with 3"):
        agent({"question": "q", "exit": 3}, base_url="u", model="m", api_key="k")
    slow = CommandAgent(["python3", "-c", "import time; time.sleep(30)"], timeout_seconds=0.5)
    started = time.monotonic()
    with pytest.raises(Exception, match="killed"):
        slow({}, base_url="u", model="m", api_key="k")
    assert time.monotonic() - started < 20  # killed at 0.5 s, not left to sleep its 30


def test_a_command_whose_attempt_lost_its_lease_is_killed_then():
    """Its rollout cancelled or timed out in the store (the heartbeat's StaleAttempt sets runner.LEASE_LOST): it ran
    on to its deadline, calling the policy, its result to be dropped. Waited for a second at a time, a command reading
    a long task on stdin still gets it whole."""
    from lightning_ray.rollout.runner import INFRASTRUCTURE_ERRORS, LEASE_LOST

    lost = threading.Event()
    told = LEASE_LOST.set(lost)
    try:
        reader = CommandAgent([sys.executable, "-c", "import sys, time; task = sys.stdin.read(); time.sleep(1.5); "
                               "print(len(task))"], timeout_seconds=60)
        assert reader({"question": "x" * 200_000}, base_url="u", model="m", api_key="k") == "200016"
        threading.Timer(0.5, lost.set).start()
        started = time.monotonic()
        with pytest.raises(INFRASTRUCTURE_ERRORS, match="lease was lost"):
            CommandAgent(["sleep", "60"], timeout_seconds=60)({}, base_url="u", model="m", api_key="k")
        assert time.monotonic() - started < 10
    finally:
        LEASE_LOST.reset(told)


def test_the_run_stopping_kills_its_running_commands_and_what_they_started(tmp_path):
    """ray.kill of a worker took its direct children at most: a command's session (a launcher's child, a tool server
    it started in the background) lived on, calling the policy of a run that had ended."""
    from lightning_ray.rollout.agents import RUNNING, kill_running

    pids = tmp_path / "pids"
    agent = CommandAgent(["sh", "-c", f"sleep 611 & echo $! > {pids}; sleep 45"], timeout_seconds=120)
    attempt = threading.Thread(target=lambda: pytest.raises(Exception, agent, {}, base_url="u", model="m",
                                                            api_key="k"))
    attempt.start()
    deadline = time.monotonic() + 30
    while not (pids.exists() and pids.read_text().strip()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    background = int(pids.read_text())
    assert kill_running() == 1  # as the worker's stop_agents does, when the run stops
    attempt.join(30)
    assert not attempt.is_alive() and not RUNNING
    deadline = time.monotonic() + 10
    while Path(f"/proc/{background}").exists() and Path(f"/proc/{background}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, "the command's background child lives on"
        time.sleep(0.05)


def test_an_in_process_agent_whose_attempt_lost_its_lease_is_left_behind_then():
    """A Python agent cannot be killed: its worker waited for it to its deadline (rollout.timeout_seconds, 600 s by
    default), taking no other rollout, for a result the store would refuse. It is left behind at once, as at its
    deadline."""
    from lightning_ray.rollout.runner import LEASE_LOST, AttemptAbandoned, _within

    lost, release = threading.Event(), threading.Event()
    told = LEASE_LOST.set(lost)
    try:
        threading.Timer(0.5, lost.set).start()
        started = time.monotonic()
        with pytest.raises(AttemptAbandoned, match="lease was lost"):
            _within(60, release.wait, 30)
        assert time.monotonic() - started < 10
    finally:
        LEASE_LOST.reset(told)
        release.set()


def test_a_command_the_platform_failed_gets_no_score_and_a_launchers_child_dies_at_the_deadline(tmp_path):
    """A command is told from the platform's failures as an in-process agent's exception is (those are retried, not
    scored 0): it could not start, the out-of-memory killer's SIGKILL, EX_TEMPFAIL (75), an OpenAI SDK's 5xx or
    connection error as its last words. At the deadline its whole process group is killed: the agent a launcher
    (`sh -c`, npx, uv run) started too, which used to run on calling the policy."""
    from lightning_ray.rollout.agents import AgentCommandFailed
    from lightning_ray.rollout.runner import INFRASTRUCTURE_ERRORS

    def failure(command: list[str]) -> Exception:
        with pytest.raises(Exception) as e:
            CommandAgent(command, timeout_seconds=30)({}, base_url="u", model="m", api_key="k")
        return e.value

    platform = [["/no/such/agent"], ["sh", "-c", "kill -9 $$"], ["sh", "-c", "exit 75"],
                [sys.executable, "-c", "raise SystemExit('openai.InternalServerError: Error code: 503 - replaced')"],
                ["sh", "-c", "echo 'Error: connect ECONNREFUSED 127.0.0.1:8000' >&2; exit 1"],
                # set up wrong, which no answer of the policy's causes: a key refused, a base URL with /v1 twice
                ["sh", "-c", "echo 'openai.AuthenticationError: Error code: 401' >&2; exit 1"],
                ["sh", "-c", "echo 'NotFoundError: 404 no such path: /v1/v1/chat/completions' >&2; exit 1"]]
    for command in platform:
        assert isinstance(failure(command), INFRASTRUCTURE_ERRORS), command
    # an in-process agent's: the same exceptions (scored 0, the run going on, before)
    import httpx
    import openai
    refused = httpx.Response(401, request=httpx.Request("POST", "http://u/v1/chat/completions"))
    assert isinstance(openai.AuthenticationError("refused", response=refused, body=None), INFRASTRUCTURE_ERRORS)
    logged = "echo 'model said: InternalServerError: Error code: 503' >&2; "  # the agent's log, not its error
    for command in (["sh", "-c", "echo 'openai.BadRequestError: Error code: 400' >&2; exit 1"],
                    ["sh", "-c", logged + "echo 'ValueError: no answer' >&2; exit 1"]):
        policys = failure(command)
        assert isinstance(policys, AgentCommandFailed) and not isinstance(policys, INFRASTRUCTURE_ERRORS), command

    pid_file = tmp_path / "child.pid"
    agent = f"sh -c 'echo $$ > {pid_file}; exec sleep 30 > /dev/null 2>&1'"  # its output elsewhere: no pipe held
    launcher = CommandAgent(["sh", "-c", f"{agent} & exec sleep 30"], timeout_seconds=2)
    with pytest.raises(Exception, match="killed"):
        launcher({}, base_url="u", model="m", api_key="k")
    child, deadline = int(pid_file.read_text()), time.monotonic() + 10
    # the launcher's child dies with it, not 30 s later
    while alive(child):
        assert time.monotonic() < deadline, "the launcher's child outlived its attempt"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"  # a zombie has died


def test_a_large_task_reaches_a_command_on_stdin(tmp_path):
    """Linux refuses an environment string past 128 KiB: a larger task goes on stdin only, not in
    LIGHTNING_RAY_TASK (the command failed to start, scored 0)."""
    script = tmp_path / "agent.py"
    script.write_text("import json, os, sys\n"
                      "print(len(json.load(sys.stdin)['text']), 'LIGHTNING_RAY_TASK' in os.environ)\n")
    agent = CommandAgent([sys.executable, str(script)], timeout_seconds=30)
    assert agent({"text": "x" * 200_000}, base_url="u", model="m", api_key="k") == "200000 False"
    assert agent({"text": "x" * 10}, base_url="u", model="m", api_key="k") == "10 True"


def test_a_command_gets_no_secret_from_the_workers_environment(tmp_path, monkeypatch):
    """The worker's environment holds credentials (cloud keys, HF_TOKEN, the operator's own): a command gets the
    basics, its endpoint and task, and the names task.agent_env gives; nothing else."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "worker-secret")
    monkeypatch.setenv("HF_TOKEN", "hf_workertoken123")
    monkeypatch.setenv("AGENT_SETTING", "passed on")
    script = tmp_path / "agent.py"
    script.write_text("import json, os\nprint(json.dumps(dict(os.environ)))\n")
    # this interpreter itself: `python3` may be a shell shim that adds variables of its own
    agent = resolve_agent(TaskConfig(command=[sys.executable, str(script)], agent_env=["AGENT_SETTING"]), 30)
    env = json.loads(agent({"question": "q"}, base_url="http://x/v1", model="m", api_key="the-attempts-key"))
    assert "worker-secret" not in json.dumps(env) and "hf_workertoken123" not in json.dumps(env)
    assert set(env) <= {*AGENT_ENV, "AGENT_SETTING", "OPENAI_BASE_URL", "OPENAI_API_KEY", "OPENAI_MODEL",
                        "LIGHTNING_RAY_TASK"}
    assert (env["AGENT_SETTING"], env["PATH"], env["OPENAI_API_KEY"]) == ("passed on", os.environ["PATH"],
                                                                          "the-attempts-key")
    assert json.loads(env["LIGHTNING_RAY_TASK"]) == {"question": "q"}
