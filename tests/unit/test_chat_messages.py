"""Chat messages as the chat template gets them (template_messages), and what /v1/chat/completions answers for them,
through the real create_chat_completion and the app's error handlers, with only the generation scripted."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from lightning_ray.serving import http
from lightning_ray.serving.adapters import AdapterRoutes
from lightning_ray.serving.app import PolicyServer
from lightning_ray.serving.chat import create_chat_completion, template_messages
from lightning_ray.serving.decoding import ChoiceDelta
from lightning_ray.serving.http import CallTrace
from lightning_ray.serving.responses import ResponsesRequest, create_response
from lightning_ray.serving.schemas import ChatCompletionRequest

ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
TWO_CALLS = ('<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>\n'
             '<tool_call>\n{"name": "add", "arguments": {"a": 3}}\n</tool_call>')


# --- template_messages --------------------------------------------------------------------------------------------

def test_developer_is_system_unless_the_template_knows_it():
    messages = [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "hi"}]
    assert [m["role"] for m in template_messages(messages)] == ["system", "user"]
    assert [m["role"] for m in template_messages(messages, "{{ messages[0]['content'] }}")] == ["system", "user"]
    knows = "{% if m['role'] == 'developer' %}<|start|>developer{% endif %}"
    assert [m["role"] for m in template_messages(messages, knows)] == ["developer", "user"]


def test_text_parts_are_joined_by_newlines_and_a_refusal_part_is_text():
    [user, assistant] = template_messages([
        {"role": "user", "content": [{"type": "text", "text": "Translate:"}, {"type": "text", "text": "Bonjour"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "No."}, {"type": "refusal", "refusal": "I can't."}]},
    ])
    assert user["content"] == "Translate:\nBonjour" and assistant["content"] == "No.\nI can't."


@pytest.mark.parametrize("text", [5, None, ["a"]])
def test_a_text_part_whose_text_is_not_a_string_is_a_value_error_naming_it(text):
    with pytest.raises(ValueError, match=r"^messages\[1\]\.content\[0\]\.text: expected a string"):
        template_messages([{"role": "user", "content": "hi"},
                           {"role": "user", "content": [{"type": "text", "text": text}]}])


# --- through create_chat_completion -------------------------------------------------------------------------------

POLICY_SERVER = next(c for c in PolicyServer.func_or_class.__mro__ if "check_request" in vars(c))


@pytest.fixture
def app_answering(tokenizer):
    """A client of the app's chat and Responses routes (its error handlers too) on a policy server whose model
    answers `completion`, 3 tokens at a time."""

    async def run(completion, fails_after, operation, prompts, *args):
        ids = tokenizer.encode(completion, add_special_tokens=False)
        for i in range(0, len(ids), 3):
            if i // 3 == fails_after:  # a bug of ours, say, with a detail no client should see
                raise RuntimeError("secret detail")
            part = ids[i:i + 3]
            yield ChoiceDelta(index=0, text=tokenizer.decode(part), token_ids=part, logprobs=[0.0] * len(part),
                              finish_reason="stop" if i + 3 >= len(ids) else None, policy_version=0)

    def make(completion: str = "Hi.", broken: str | None = None, fails_after: int | None = None) -> TestClient:
        """fails_after: the model raises after that many deltas."""
        server = object.__new__(POLICY_SERVER)  # its __init__ starts an engine inside a Serve replica
        server.model_name, server.tokenizer, server.max_model_len, server.defaults = "tiny", tokenizer, 512, {}
        server.rollout_sampling, server.taught, server.adapters = {}, {}, AdapterRoutes("tiny", False)
        server.tool_format, server.engine = "hermes", SimpleNamespace(policy_version=0, broken=broken)
        server.run = lambda *args: run(completion, fails_after, *args)
        api = FastAPI()
        http.install(api)

        @api.post("/v1/chat/completions")
        async def chat(body: ChatCompletionRequest):
            return http.answer(await create_chat_completion(server, body, CallTrace(None, None)))

        @api.post("/v1/responses")
        async def responses(body: ResponsesRequest):
            return http.answer(await create_response(server, body, CallTrace(None, None)))

        return TestClient(api, raise_server_exceptions=fails_after is None)  # else its 500, as a client sees it

    return make


def chunks(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.parametrize("route, body", [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                                         ("/v1/responses", {"input": "hi"})], ids=["chat", "responses"])
def test_a_crash_is_a_server_error_saying_nothing_of_it_and_a_broken_stream_ends_with_it(app_answering, route, body):
    """An exception of ours: an OpenAI error body with its type's name only (its text may hold anything), and a
    stream it breaks, after some deltas went out, closes with an error event, not as a complete answer cut short
    (which an agent would take as the policy's, and the trace train on)."""
    body = {"model": "tiny", **body}
    r = app_answering("Hello there, how are you today?", fails_after=0).post(route, json=body)
    assert r.status_code == 500 and "secret" not in r.text
    assert r.json()["error"] == {**r.json()["error"], "type": "server_error", "message": "internal error: RuntimeError"}
    r = app_answering("Hello there, how are you today?", fails_after=2).post(route, json={**body, "stream": True})
    assert r.status_code == 200 and "secret" not in r.text  # its headers had gone out with the first delta
    assert chunks(r)[-1]["error"]["message"] == "internal error: RuntimeError" and len(chunks(r)) > 2
    if route == "/v1/responses":  # response.failed before the error event, with the error as the response's
        assert chunks(r)[-2]["response"]["status"] == "failed"


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_answers_one_call(app_answering, stream):
    client = app_answering(TWO_CALLS)
    for parallel, arguments in ((None, [{"a": 2}, {"a": 3}]), (False, [{"a": 2}])):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "2?"}], "tools": [ADD], "stream": stream,
                **({} if parallel is None else {"parallel_tool_calls": parallel})}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200
        if stream:
            calls = [c for chunk in chunks(r) for c in chunk["choices"][0]["delta"].get("tool_calls", [])]
            assert [c["index"] for c in calls] == list(range(len(arguments)))
            assert chunks(r)[-1]["choices"][0]["finish_reason"] == "tool_calls"
        else:
            calls = r.json()["choices"][0]["message"]["tool_calls"]
        assert [json.loads(c["function"]["arguments"]) for c in calls] == arguments


def test_a_developer_message_is_rendered_as_the_system_turn(app_answering, tokenizer):
    r = app_answering().post("/v1/chat/completions", json={"model": "tiny", "messages": [
        {"role": "developer", "content": "Be terse."}, {"role": "user", "content": "hi"}]})
    assert tokenizer.decode(r.json()["prompt_token_ids"]).startswith("<|im_start|>system\nBe terse.<|im_end|>")


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}],
                              "stream": True}, "messages[0].content[0].text"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": None}]}]},
     "input[0].content[0].text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": 2**64}, "seed"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": -2**63 - 1,
                              "stream": True}, "seed"),
])
def test_bad_values_are_a_400_naming_their_param(app_answering, path, body, param):
    r = app_answering().post(path, json={"model": "tiny", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_seeds_in_int64_are_served(app_answering):
    for seed in (-2**63, 2**63 - 1):
        r = app_answering().post("/v1/chat/completions", json={"model": "tiny", "seed": seed,
                                                              "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                                        ("/v1/responses", {"input": "hi"})])
def test_a_replica_being_replaced_answers_a_stream_503_before_any_chunk(app_answering, path, body):
    """A 503 is what the OpenAI SDKs and LangChain retry; a streamed 200 with the error in-band was none (and the
    agent's failure was scored 0)."""
    for stream in (False, True):
        r = app_answering(broken="engine core died").post(path, json={"model": "tiny", "stream": stream, **body})
        assert r.status_code == 503 and r.json()["error"]["code"] == "replica_unhealthy"


@pytest.mark.parametrize("legacy", [{"functions": [ADD["function"]]}, {"function_call": "auto"}])
def test_the_deprecated_functions_are_refused_not_ignored(app_answering, legacy):
    """Ignored, the model never saw the functions: the agent waited for a call that could not come."""
    r = app_answering().post("/v1/chat/completions", json={"model": "tiny", **legacy,
                                                          "messages": [{"role": "user", "content": "2?"}]})
    assert r.status_code == 422 and r.json()["error"]["param"] == next(iter(legacy))
    assert "tools and tool_choice" in r.json()["error"]["message"]
