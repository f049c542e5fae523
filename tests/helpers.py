"""What tests share besides fixtures (conftest.py): the repository's root, ports a job can bind later, an
instrumented agent's OpenTelemetry spans, the lightning-ray command. Importable as `helpers` from any folder of
tests (pyproject's pytest `pythonpath`)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lightning_ray.config import TrainConfig, validate
from lightning_ray.models.tiny import EASY
from lightning_ray.tracing import semconv
from lightning_ray.types import Transition

ROOT = Path(__file__).resolve().parents[1]  # the repository


# Ports handed to a job that binds them later. The kernel hands out port-0 binds and outgoing connections from its
# ephemeral range (/proc/sys/net/ipv4/ip_local_port_range: 32768-60999 by default), and Ray's workers bind ports in
# 10002-19999: a port picked from either could be taken by someone else before the job binds it. Below both, only
# a process that names the port itself can.
PORT_RANGE = range(20_000, 32_768)
_ports = random.Random(os.getpid()).sample(PORT_RANGE, len(PORT_RANGE))  # each pytest process its own order


def free_ports(n: int) -> list[int]:
    """n ports free on 127.0.0.1 now, outside the ranges the kernel and Ray take ports from (PORT_RANGE), and
    never the same one twice in a session (tests that start a job in a subprocess give it one)."""
    found = []
    while len(found) < n:
        port = _ports.pop()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        found.append(port)
    return found


def free_port() -> int:
    return free_ports(1)[0]


def agent_otel_spans(rollout_id: str, attempt_id: str, model: str = "tiny-calc"):
    """Real SDK spans from a GenAI-instrumented agent: a chat call with its events, inside an agent span."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "outside-agent",
                                                        semconv.ROLLOUT_ID: rollout_id,
                                                        semconv.ATTEMPT_ID: attempt_id}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("agent")
    with tracer.start_as_current_span("invoke_agent calc", attributes={"gen_ai.agent.name": "calc"}):
        with tracer.start_as_current_span("chat tiny-calc", attributes={
                "gen_ai.operation.name": "chat", "gen_ai.request.model": model, "gen_ai.usage.input_tokens": 12}) as s:
            s.add_event("gen_ai.user.message", {"content": "What is 3 + 4?"})
    return provider, exporter.get_finished_spans()


# The lightning-ray command as a test runs it (tests of the CLI and of resuming a run)
CLI = [sys.executable, "-m", "lightning_ray.cli"]
# a run small enough for a test: the tiny model on the HF engine, one iteration of 8 GRPO groups, 4 held-out problems,
# on the sums and differences it was warmed up on (a group with rewards that differ: an update, a checkpoint)
TINY = [*(f"++task.generator.{key}={json.dumps(value)}" for key, value in EASY.items()),
        "model=tiny", "engine=hf",
        "ray.num_cpus=4", "rollout.num_workers=1", "rollout.agents_per_worker=8", "rollout.tasks_per_iteration=8",
        "rollout.group_size=4", "rollout.temperature=1.0", "task.eval_size=4",
        "trainer.iterations=1", "trainer.eval_every=1", "learner.threads_per_worker=1"]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


# The settings tests run the loop with, named: on top of the code's defaults (what `make train` runs), the tiny
# model's positions (model.path null: the tiny model), the HF engine, two short iterations of a few GRPO groups at
# temperature 1, one sample per call (transition level), a checkpoint after each iteration, one rollout worker and
# no store API (its agents all run in Ray: a process and a Serve app fewer to start, and a run's start is most of a
# test's CPU; the CLI's tests run it). A test's own dict overrides them key by key.
SMALL = {
    "engine": {"kind": "hf", "max_model_len": 512},
    "rollout": {"tasks_per_iteration": 4, "num_workers": 1, "agents_per_worker": 8, "temperature": 1.0},
    "algorithm": {"level": "transition"},
    "trainer": {"iterations": 2, "checkpoint_every": 1},
    "learner": {"lr": 1e-5, "step_timeout_s": 600},
    "store": {"http": False},
}


def kill_session(leader: subprocess.Popen) -> None:
    """SIGKILL a process started with `start_new_session=True` and everything in its session, as a node's crash
    would: Ray's workers each lead a process group of their own, so killing the leader's group leaves them running
    (and writing) for a while. Returns once none is left."""
    def members() -> list[int]:
        pids = []
        for entry in os.listdir("/proc"):
            try:
                if entry.isdigit() and os.getsid(int(entry)) == leader.pid \
                        and Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(entry))
            except (OSError, IndexError):  # ended meanwhile
                pass
        return pids

    while pids := members():
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        leader.poll()  # reaps the leader: a zombie is no member
        time.sleep(0.05)
    leader.wait()


def small(raw: dict, schema: type[TrainConfig] = TrainConfig) -> TrainConfig:
    """The validated config of a test's run: SMALL, with `raw` merged over it."""
    def merged(base: dict, top: dict) -> dict:
        return {**base, **{k: merged(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
                           for k, v in top.items()}}
    return validate(merged(SMALL, raw), schema)


def served_adapters(run_dir: Path) -> set[tuple[str | None, str | None]]:
    """(agent, adapter) of every call a run's policy server recorded (algorithm.adapters): who asked, and which
    adapter answered."""
    import sqlite3

    from lightning_ray.algorithm.select import agent_of
    from lightning_ray.types import Span

    db = sqlite3.connect(Path(run_dir) / "traces-spans.sqlite")
    try:
        spans = [Span(span_id=r[0], parent_id=r[1], rollout_id=r[2], name=r[3], start_time=0,
                      attributes=json.loads(r[4]), origin=r[5])
                 for r in db.execute("SELECT span_id, parent_id, rollout_id, name, attributes, origin FROM spans "
                                     "WHERE rollout_id IS NOT NULL")]
    finally:
        db.close()
    by_id = {s.span_id: s for s in spans}
    return {(agent_of(s, by_id), s.attributes.get(semconv.ADAPTER)) for s in spans
            if s.name == semconv.LLM_CALL and s.origin == "server"}


def publish(registry, state: dict, version: int, timeout_s: float = 60.0) -> None:
    """Publish a state dict as the trainer does (through the object store) and wait until every replica has it."""
    import ray

    ray.get(registry.publish.remote(version, [ray.put(state)]))
    ray.get(registry.wait_synced.remote(version, timeout_s))


def stream_while_publishing(deployed, publish_version, n: int) -> tuple[list[str], list, float, float]:
    """Stream n choices of 400 tokens of the tiny model and publish_version() (version 1, until every replica has it)
    once the first tokens are out (a frame with content: the first frames can come before any token, and a call
    aborted before its first token has nothing to record): the stream's frames, the call's spans, when the update was
    synced and when the stream ended (seconds from the publish)."""
    import threading

    import httpx

    body = {"model": "tiny-calc", "messages": [{"role": "user", "content": "What is 3 + 4?"}], "max_tokens": 400,
            "ignore_eos": True, "n": n, "stream": True}
    rollout, frames, first, ended = deployed["new_rollout"](), [], threading.Event(), []

    def stream():
        with httpx.stream("POST", deployed["url"] + "/v1/chat/completions", json=body, timeout=120,
                          headers={"X-Rollout-Id": rollout}) as r:
            for line in r.iter_lines():
                frames.append(line)
                if not first.is_set() and line.startswith("data: {") and any(
                        c.get("delta", {}).get("content") for c in json.loads(line[6:]).get("choices", [])):
                    first.set()
        ended.append(time.time())

    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(30)
    start = time.time()
    publish_version()
    synced = time.time() - start
    reader.join(120)
    return frames, deployed["store"].query_spans([rollout]), synced, ended[0] - start


# ---- engines' logprobs against a plain HF forward pass ----------------------------------------------------------
ATOL = 1e-3  # measured max |vLLM - HF| on the tiny model in fp32: ~2e-6


def rescore(model, prompt: list[int], ids: list[int], temperature: float = 1.0, top_p: float = 1.0):
    """Each generated position's logprobs [len(ids), vocab] under the distribution a token is drawn from there: the
    softmax at `temperature` (0: greedy, untempered), within the smallest set of most likely tokens whose
    probability reaches `top_p`, renormalized (-inf outside it)."""
    import torch

    with torch.inference_mode():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
    logprobs = torch.log_softmax(logits / (temperature or 1.0), -1)
    if temperature and top_p < 1.0:
        for row in logprobs:
            probs, order = row.exp().sort(descending=True)
            outside = order[probs.cumsum(0) - probs >= top_p]
            row[outside] = -torch.inf
            row -= row.logsumexp(0)
    return logprobs


def perturbed(model, seed: int):
    """A copy of the model with every weight moved by noise (tied weights stay tied)."""
    import copy

    import torch

    new, rng = copy.deepcopy(model), torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=rng) * 0.2 * p.std())
    return new


def logprob_errors(model, prompt: list[int], ids: list[int], logprobs: list[float], **sampling):
    """|reported - HF| per token under the given model (drawn with `sampling`: rescore's temperature, top_p)."""
    import torch

    expected = rescore(model, prompt, ids, **sampling).gather(1, torch.tensor(ids)[:, None])[:, 0]
    return (torch.tensor(logprobs) - expected).abs()


def logprob_error(model, prompt: list[int], ids: list[int], logprobs: list[float], **sampling) -> float:
    """Max |reported - HF| under the given model."""
    return logprob_errors(model, prompt, ids, logprobs, **sampling).max().item()


def check_kept_generation(engine, old_model, run) -> None:
    """serve.drain=keep at the engine: a weight update landing mid-generation neither waits for it nor ends it; the
    tokens up to the update are the old version's, the rest the new one's, each token's logprob its own version's
    over the whole context (the engine read it again under the new weights), and the last delta (or the deltas' own
    versions) says where the versions changed. `run(coro)` runs a coroutine on the engine's event loop."""
    from lightning_ray.serving.decoding import Choice, ChoiceDelta, collect
    from lightning_ray.serving.engines import SamplingParams

    tok, v = engine.tokenizer, engine.policy_version
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], tokenize=False,
                                                add_generation_prompt=True))
    new_model = perturbed(old_model, seed=3)

    async def scenario():
        choices: dict[int, Choice] = {}
        params = SamplingParams(max_tokens=480 - len(prompt), ignore_eos=True, seed=0)
        async for d in engine.stream(prompt, params):
            collect(choices, ChoiceDelta(index=0, text="", **d.model_dump()))
            if len(choices[0].token_ids) >= 8 and engine.policy_version == v:  # under way: the update lands now
                await engine.load_weights(new_model.state_dict(), version=v + 1)
        return choices[0]

    try:
        c = run(scenario())
    finally:
        run(engine.load_weights(old_model.state_dict(), version=v + 2))
    n = len(c.token_ids)
    assert c.finish_reason == "length" and n == 480 - len(prompt)
    [(old, _, switch), (new, at, end)] = c.version_spans  # two versions, in order, one switch
    assert (old, new, at, end) == (v, v + 1, switch, n) and 8 <= switch < n, c.version_spans
    assert c.policy_version == v  # the oldest: what staleness is measured by
    errors_old = logprob_errors(old_model, prompt, c.token_ids, c.logprobs)
    errors_new = logprob_errors(new_model, prompt, c.token_ids, c.logprobs)
    assert errors_old[:switch].max() < ATOL and errors_new[switch:].max() < ATOL
    assert errors_new[:switch].max() > 0.01 and errors_old[switch:].max() > 0.01  # the two versions do differ


def random_transitions(vocab: int, n: int = 8) -> list[Transition]:
    """n transitions of random tokens (24 of prompt, 8 of response), rewards and advantages alternating ±1, in
    groups of 4: a batch a learner can step on (its made-up served logprobs want learner.max_logprob_gap=None)."""
    rng = random.Random(0)
    return [Transition(rollout_id=f"r{i}", group_id=f"g{i // 4}", span_id=f"s{i}",
                       prompt_ids=[rng.randrange(vocab) for _ in range(24)],
                       response_ids=[rng.randrange(vocab) for _ in range(8)], logprobs=[-1.0] * 8, reward=i % 2,
                       returns=i % 2, advantage=1.0 if i % 2 else -1.0, policy_version=0, temperature=1.0)
            for i in range(n)]


def board_events(logdir: Path) -> list:
    """The TensorBoard events in a run's tensorboard/ directory, file by file in the order written: each file a
    TFRecord stream (an 8-byte length, its CRC, the serialized Event, its CRC), read as TensorBoard reads it."""
    from tensorboardX.proto.event_pb2 import Event

    events = []
    for path in sorted(logdir.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime_ns):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack_from("<Q", data, at)
            events.append(Event.FromString(data[at + 12:at + 12 + length]))
            at += 12 + length + 4
    return events


def board_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} as TensorBoard shows it: a session restarted at a step (purge_step) hides what the runs
    before it wrote at that step and later."""
    scalars: dict[str, dict[int, float]] = {}
    for e in board_events(logdir):
        if e.HasField("session_log") and e.session_log.status == e.session_log.START:
            for steps in scalars.values():
                for step in [s for s in steps if s >= e.step]:
                    del steps[step]
        for v in e.summary.value:
            scalars.setdefault(v.tag, {})[e.step] = v.simple_value
    return scalars
