"""A teacher behind the policy server (serving/teacher.py): a taught rollout's calls are answered by the teacher and
recorded as the policy's own tokens, scored by the policy and marked as the teacher's; the other rollouts' calls stay
the policy's. The teacher here is the tiny model itself, greedy: loaded beside the policy (`model`), or asked through
the OpenAI API of this very server, outside any rollout (`endpoint`)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from openai import OpenAI

from lightning_ray.serving.teacher import TAUGHT, make_teacher
from lightning_ray.tasks import calc
from lightning_ray.tracing import semconv
from lightning_ray.types import Task

MODEL = "tiny-calc"
# The calc agent's own opening and a question of the kind the tiny model was warmed up on: its greedy answer (a CALC
# line) ends its turn. Off that distribution ("Solve the arithmetic.") the tiny model's greedy answer depends on the
# machine that built it (CPU kernels round differently): on one it looped "4 + 4 + ..." to max_tokens.
MESSAGES = [*calc.opening({"dataset": "basic_arithmetic", "protocol": "text"}),
            {"role": "user", "content": "Calculate 3 + 4."}]


@pytest.fixture(scope="module", params=["model", "endpoint"])
def server(request, policy_app, tiny_model_path, serve_port):
    where = {"model": {"path": str(tiny_model_path)},
             "endpoint": {"base_url": f"http://127.0.0.1:{serve_port}/v1", "model": MODEL}}[request.param]
    teacher = {"kind": request.param, **where, "temperature": 0.0, "max_tokens": 64}
    with policy_app(teacher=teacher, algorithm={"objective": "sft"}) as app:
        yield {**app, "teacher": f"{request.param}:{tiny_model_path if request.param == 'model' else MODEL}"}


def rollout(server, taught: bool) -> str:
    task = Task(task_id="t", input={}, sampling={TAUGHT: True} if taught else {})
    return server["store"].enqueue([task])[0].rollout_id


def chat(server, rollout_id: str, temperature: float = 0.0):
    client = OpenAI(base_url=f"{server['url']}/rollouts/{rollout_id}/attempts/at-1/v1", api_key="-", max_retries=0)
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=temperature, max_tokens=64,
                                          logprobs=True)


def test_a_taught_call_is_the_teachers_answer_as_the_policys_own_tokens(server):
    taught, own = rollout(server, True), rollout(server, False)
    a, b = chat(server, taught, temperature=0.7), chat(server, own)
    [ta] = server["store"].query_spans([taught])
    [tb] = server["store"].query_spans([own])
    assert ta.attributes[semconv.TEACHER] == server["teacher"] and semconv.TEACHER not in tb.attributes
    assert b.choices[0].finish_reason == "stop"  # the policy's greedy answer ended its turn within 64 tokens
    # The teacher is the policy's own model, greedy: its answer, rendered in the policy's template and scored by the
    # policy, is the policy's greedy answer token for token, with the logprobs sampling them gave: untempered, what
    # the call asked notwithstanding (scored, not drawn), and so recorded, to be imitated at temperature 1.
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].token_ids == b.choices[0].token_ids
    assert ta.attributes[semconv.COMPLETION_TOKEN_IDS].tolist() == tb.attributes[semconv.COMPLETION_TOKEN_IDS].tolist()
    np.testing.assert_allclose(ta.attributes[semconv.LOGPROBS], tb.attributes[semconv.LOGPROBS], atol=1e-4)
    assert ta.attributes[semconv.SAMPLING]["temperature"] == 1.0
    assert [t.logprob for t in a.choices[0].logprobs.content] == ta.attributes[semconv.LOGPROBS].tolist()


def test_a_taught_rollouts_text_completion_is_refused(server):
    rid = rollout(server, True)
    r = httpx.post(f"{server['url']}/rollouts/{rid}/attempts/at-1/v1/completions",
                   json={"model": MODEL, "prompt": "3 + 4 =", "max_tokens": 4}, timeout=30)
    assert r.status_code == 400 and "teacher" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages"


def test_a_model_teacher_leaves_its_replicas_random_stream_alone(tiny_model_path):
    """A `model` teacher's engine starts in the policy's replica after the policy's, which seeded the process's
    generator with the replica's own seed (so replicas sample apart) and, on a GPU, capped its memory at the
    engine's share: the teacher's leaves both as they were."""
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    make_teacher("model", "calc", path=str(tiny_model_path))
    assert torch.equal(torch.rand(4), expected)
