"""The Responses API mapping: requests to chat, completions to Response objects and stream events, checked against
our JSON Schema of the API reference (tests/schemas/responses.json), the official openai client's own types and,
through the real create_response behind an in-process HTTP transport, its parser and stream accumulator."""

from __future__ import annotations

import asyncio
import json
from functools import partial
from types import SimpleNamespace

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from lightning_ray.serving.adapters import AdapterRoutes
from lightning_ray.serving.app import PolicyServer
from lightning_ray.serving.decoding import ChoiceDelta
from lightning_ray.serving.engines import SamplingParams
from lightning_ray.serving.http import ApiError, CallTrace, error_response
from lightning_ray.serving.responses import (ResponseEventStream, ResponsesRequest, create_response, to_chat,
                                             to_response)
from lightning_ray.serving.sse import frame
from lightning_ray.serving.tools import ToolCallStreamParser, parse_tool_calls
from openai_schema import CheckedTransport, check_stream, violations

ADD = {"type": "function", "name": "add", "description": "Add", "strict": True,
       "parameters": {"type": "object", "properties": {"a": {"type": "number"}}, "required": ["a"]}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)


def request(**kw) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "tiny", "input": "hi", **kw})


def response_of(req: ResponsesRequest, **kw) -> dict:
    """to_response's Response object, once checked against the schema of the reference."""
    body = to_response(req, **kw)
    assert not violations("responses.json", "Response", body)
    return body


def conforming_events(events: list[dict]) -> list[dict]:
    """Stream events, once checked against the schema, each as the named SSE frame the server sends."""
    assert not check_stream("/v1/responses", [(e["type"], json.dumps(e)) for e in events])
    return events


# --- the request --------------------------------------------------------------------------------------------------

def test_request_ignores_unknown_fields_and_keeps_known_ones():
    req = request(tools=[ADD], tool_choice="required", max_output_tokens=64, store=True, metadata={"k": "v"},
                  prompt_cache_retention="24h", include=["message.output_text.logprobs"], prompt_cache_key="x",
                  text={"format": {"type": "text"}})
    assert req.max_output_tokens == 64 and req.tools == [ADD] and not hasattr(req, "prompt_cache_retention")
    assert req.prompt_cache_key == "x"  # echoed in the Response


@pytest.mark.parametrize("fields, message", [
    ({"previous_response_id": "resp_1"}, "previous_response_id is not supported"),
    ({"background": True}, "background is not supported"),
    ({"conversation": "conv_1"}, "conversation is not supported"),
    ({"tools": [{"type": "web_search"}]}, "only function tools are supported, not 'web_search'"),
    ({"tools": [{"type": "function"}]}, "needs a name"),
    ({"max_output_tokens": 0}, "greater than 0"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
])
def test_request_rejects_what_a_stateless_chat_server_cannot_do(fields, message):
    with pytest.raises(ValidationError) as e:
        request(**fields)
    assert message in str(e.value)


# --- to_chat ------------------------------------------------------------------------------------------------------

def test_string_input_and_instructions():
    assert to_chat(request(instructions="Be brief.")) == (
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], None, None)


def test_items_become_messages_and_tools_become_chat_tools():
    req = request(tools=[ADD], tool_choice={"type": "function", "name": "add"}, input=[
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "2+2"},
                                                        {"type": "input_text", "text": "then 3+3"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Adding.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "add", "arguments": '{"a": 2}'},
        {"type": "function_call", "call_id": "c2", "name": "add", "arguments": ""},
        {"type": "function_call_output", "call_id": "c1", "output": "4"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "6"}]},
        {"role": "user", "content": "thanks"},
    ])
    messages, tools, choice = to_chat(req)
    assert messages == [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "2+2\nthen 3+3"},
        {"role": "assistant", "content": "Adding.", "tool_calls": [  # text and calls of one turn stay one message
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}},
            {"id": "c2", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "4"},
        {"role": "tool", "tool_call_id": "c2", "content": "6"},
        {"role": "user", "content": "thanks"},
    ]
    assert tools == [{"type": "function", "function": {k: v for k, v in ADD.items() if k != "type"}}]
    assert choice == {"type": "function", "function": {"name": "add"}}


def test_function_calls_after_a_tool_result_start_a_new_assistant_message():
    messages, _, _ = to_chat(request(input=[
        {"role": "user", "content": "go"},
        {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "a", "output": "1"},
        {"type": "function_call", "call_id": "b", "name": "f", "arguments": "{}"},
    ]))
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[1]["content"] is None and messages[3]["tool_calls"][0]["id"] == "b"


@pytest.mark.parametrize("item, message", [
    ({"type": "item_reference", "id": "msg_1"}, "input[0]: item_reference is not supported"),
    ({"type": "web_search_call", "id": "ws_1"}, "input[0]: input item type 'web_search_call' is not supported"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}, "'input_image' is not supported"),
    ({"role": "tool", "content": "x"}, "role must be"),
    ({"type": "function_call", "name": "f"}, "needs call_id and name"),
    ({"type": "function_call_output", "output": "x"}, "needs call_id"),
    ({"role": "user", "content": 5}, "content must be"),
    ({"role": "user", "content": [{"type": "input_text", "text": None}]},
     "input[0].content[0].text: expected a string"),
    ({"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "a"},
                                                                   {"type": "input_text", "text": 5}]},
     "input[0].output[1].text: expected a string"),
])
def test_unsupported_input_is_a_clear_value_error(item, message):
    with pytest.raises(ValueError) as e:
        to_chat(request(input=[item]))
    assert message in str(e.value)


def test_unsupported_tool_choice_is_a_value_error():
    with pytest.raises(ValueError, match="tool_choice"):
        to_chat(request(tools=[ADD], tool_choice={"type": "web_search_preview"}))


# --- to_response --------------------------------------------------------------------------------------------------

def test_text_response_is_what_the_client_parses():
    req = request(instructions="Be brief.", temperature=0.5, metadata={"run": "1"})
    body = response_of(req, content="5", tool_calls=[], input_tokens=7, output_tokens=2)
    resp = Response.model_validate(body)
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == "tiny"
    assert resp.status == "completed" and resp.incomplete_details is None and resp.error is None
    assert resp.output_text == "5" and resp.output[0].type == "message" and resp.output[0].status == "completed"
    assert (resp.usage.input_tokens, resp.usage.output_tokens, resp.usage.total_tokens) == (7, 2, 9)
    assert resp.usage.input_tokens_details.cached_tokens == 0 and resp.usage.output_tokens_details.reasoning_tokens == 0
    assert (resp.instructions, resp.temperature, resp.metadata, resp.tool_choice) == ("Be brief.", 0.5, {"run": "1"},
                                                                                    "auto")
    assert json.loads(json.dumps(body)) == body  # plain JSON


def test_tool_call_response_and_its_round_trip_into_the_next_request():
    req = request(tools=[ADD], tool_choice="auto")
    body = response_of(req, content="Let me add.", tool_calls=[CALL], input_tokens=3, output_tokens=9)
    resp = Response.model_validate(body)
    assert [o.type for o in resp.output] == ["message", "function_call"]
    fc = resp.output[1]
    assert (fc.call_id, fc.name, fc.arguments, fc.status) == ("call_1", "add", '{"a": 2}', "completed")
    assert fc.id.startswith("fc_") and resp.tools[0].name == "add" and resp.tools[0].strict is True
    # The Agents SDK sends the output back as input, with the tool's result.
    follow_up = request(tools=[ADD], input=[{"role": "user", "content": "2?"},
                                            *[o.model_dump(exclude_none=True) for o in resp.output],
                                            {"type": "function_call_output", "call_id": "call_1", "output": "2"}])
    messages, _, _ = to_chat(follow_up)
    assert messages[1] == {"role": "assistant", "content": "Let me add.", "tool_calls": [CALL]}
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": "2"}


def test_calls_only_response_has_no_message_and_empty_completion_has_an_empty_one():
    only_calls = Response.model_validate(response_of(request(), content=None, tool_calls=[CALL, CALL],
                                                     input_tokens=1, output_tokens=1))
    assert [o.type for o in only_calls.output] == ["function_call", "function_call"]
    empty = Response.model_validate(response_of(request(), content=None, tool_calls=[], input_tokens=1,
                                                output_tokens=0))
    assert [o.type for o in empty.output] == ["message"] and empty.output_text == ""


def test_length_finish_is_incomplete():
    resp = Response.model_validate(response_of(request(max_output_tokens=4), content="abc", tool_calls=[],
                                               input_tokens=1, output_tokens=4, finish_reason="length"))
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[0].status == "incomplete" and resp.max_output_tokens == 4


# --- streaming events ---------------------------------------------------------------------------------------------

def stream_events(req, text, chunk=3, finish_reason="stop"):
    """What the server would send for a completion arriving `chunk` characters at a time."""
    parser, stream = ToolCallStreamParser(), ResponseEventStream(req)
    events = stream.start()
    for i in range(0, len(text), chunk):
        events += stream.delta(parser.feed(text[i:i + chunk]))
    events += stream.delta(parser.finish())
    return conforming_events(events + stream.finish(input_tokens=5, output_tokens=len(text),
                                                    finish_reason=finish_reason))


def types(events):
    return [e["type"].removeprefix("response.") for e in events]


def test_text_stream_sequence_validates_against_the_client_types():
    events = stream_events(request(), "The answer is 5.")
    parsed = [STREAM_EVENT.validate_python(e) for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert types(events)[:4] == ["created", "in_progress", "output_item.added", "content_part.added"]
    assert types(events)[-4:] == ["output_text.done", "content_part.done", "output_item.done", "completed"]
    assert "".join(e.delta for e in parsed if e.type == "response.output_text.delta") == "The answer is 5."
    assert parsed[0].response.status == "in_progress" and parsed[0].response.output == []
    final = parsed[-1].response
    assert final.status == "completed" and final.output_text == "The answer is 5." and final.usage.input_tokens == 5
    assert final.output[0].id == parsed[2].item.id  # the same item throughout


def test_tool_call_stream_matches_the_non_streamed_response():
    text = "Let me add.\n<tool_call>\n" + '{"name": "add", "arguments": {"a": 2}}' + "\n</tool_call>\n" \
           + '<tool_call>{"name": "add", "arguments": {"a": 3}}</tool_call>'
    req = request(tools=[ADD])
    events = stream_events(req, text)
    for e in events:
        STREAM_EVENT.validate_python(e)
    assert types(events) == [
        "created", "in_progress",
        "output_item.added", "content_part.added", *["output_text.delta"] * types(events).count("output_text.delta"),
        "output_text.done", "content_part.done", "output_item.done",
        *["output_item.added", "function_call_arguments.delta", "function_call_arguments.done",
          "output_item.done"] * 2,
        "completed",
    ]
    streamed = Response.model_validate(events[-1]["response"])
    content, calls = parse_tool_calls(text)
    whole = Response.model_validate(response_of(req, content=content, tool_calls=calls, input_tokens=5,
                                                output_tokens=len(text)))
    def strip_ids(r):
        return [{k: v for k, v in o.model_dump().items() if k not in ("id", "call_id")} for o in r.output]
    assert strip_ids(streamed) == strip_ids(whole)
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [json.loads(e["arguments"]) for e in done] == [{"a": 2}, {"a": 3}]
    assert [e["output_index"] for e in done] == [1, 2]


def test_text_after_a_tool_call_opens_a_second_message():
    stream = ResponseEventStream(request())
    events = stream.start() + stream.text("A") + stream.tool_call(CALL) + stream.text("B")
    events = conforming_events(events + stream.finish(input_tokens=1, output_tokens=3))
    final = Response.model_validate(events[-1]["response"])
    assert [o.type for o in final.output] == ["message", "function_call", "message"]
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    assert added == [0, 1, 2]


def test_empty_and_truncated_streams():
    empty = stream_events(request(), "")
    assert types(empty)[2:] == ["output_item.added", "content_part.added", "output_text.done", "content_part.done",
                                "output_item.done", "completed"]
    cut = stream_events(request(), "abc <tool_call>{\"na", finish_reason="length")
    final = STREAM_EVENT.validate_python(cut[-1])
    assert final.type == "response.incomplete" and final.response.incomplete_details.reason == "max_output_tokens"
    assert final.response.output_text == 'abc <tool_call>{"na' and final.response.output[0].status == "incomplete"


def test_an_event_is_one_named_sse_frame():
    event = ResponseEventStream(request()).start()[0]
    text = frame(event, event["type"])
    assert text.startswith("event: response.created\ndata: ") and text.endswith("\n\n")
    assert json.loads(text.split("data: ", 1)[1]) == event


# --- the reference's required fields -----------------------------------------------------------------------------

def test_response_echoes_the_request_in_the_documented_shape():
    """Every field the reference requires, with the sampling actually used (not null), function tools and a
    json_schema format in their documented shapes, and the request's identifiers echoed."""
    fmt = {"type": "json_schema", "name": "a", "schema": {"type": "object"}}
    tool = {"type": "function", "name": "lookup", "parameters": {"type": "object"}}  # no description, no strict
    req = request(tools=[tool], text={"format": fmt, "verbosity": "low"}, reasoning={"effort": "low"},
                  prompt_cache_key="k", safety_identifier="u1", max_tool_calls=3)
    params = SamplingParams(max_tokens=8, temperature=0.6, top_p=0.9)
    body = response_of(req, content="{}", tool_calls=[], input_tokens=1, output_tokens=2, params=params)
    assert (body["temperature"], body["top_p"], body["presence_penalty"], body["frequency_penalty"]) == \
        (0.6, 0.9, 0.0, 0.0)
    assert body["tools"] == [{"type": "function", "name": "lookup", "description": None,
                              "parameters": {"type": "object"}, "strict": None}]
    assert body["text"] == {"verbosity": "low", "format": {**fmt, "description": None, "strict": None}}
    assert body["reasoning"] == {"effort": "low", "summary": None}
    assert (body["prompt_cache_key"], body["safety_identifier"], body["max_tool_calls"]) == ("k", "u1", 3)
    assert body["completed_at"] >= body["created_at"] and body["background"] is False
    # without the sampling used, the request's or the API's defaults: never null
    assert (response_of(request(), content="", tool_calls=[], input_tokens=1, output_tokens=0)["temperature"]) == 1.0


@pytest.mark.parametrize("field", ["completed_at", "presence_penalty", "top_logprobs", "service_tier",
                                   "prompt_cache_key", "safety_identifier", "background", "max_tool_calls"])
def test_the_schema_requires_what_the_reference_requires(field):
    """The schema can fail: the same body without one required field, or with null sampling, is rejected."""
    body = to_response(request(), content="hi", tool_calls=[], input_tokens=1, output_tokens=1)
    assert not violations("responses.json", "Response", body)
    assert violations("responses.json", "Response", {k: v for k, v in body.items() if k != field})
    assert violations("responses.json", "Response", {**body, "temperature": None})


def test_a_failed_stream_ends_with_response_failed_and_an_error_event():
    stream = ResponseEventStream(request())
    events = stream.start() + stream.text("par")
    events = conforming_events(events + stream.fail(ApiError(503, "weights are loading", code="unavailable",
                                                             type="server_error")))
    failed, error = events[-2:]
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "unavailable", "message": "weights are loading"}
    assert error["type"] == "error" and error["message"] == "weights are loading"
    assert error["error"] == {"type": "server_error", "code": "unavailable", "message": "weights are loading",
                              "param": None}


# --- through the official client and the real create_response ---------------------------------------------------

COMPLETION = "Checking.\n<tool_call>\n" + '{"name": "add", "arguments": {"a": 2}}' + "\n</tool_call>"


async def scripted_run(tokenizer, completion: str, fail_after: int | None, *args):
    """What the policy server's `run` yields, for a model that answers `completion`, 3 tokens at a time; with
    `fail_after`, the generation fails after that many tokens (a weight load that gave up, an engine crash)."""
    ids = tokenizer.encode(completion, add_special_tokens=False)
    for i in range(0, len(ids), 3):
        if fail_after is not None and i >= fail_after:
            raise ApiError(503, "the generation was cut short", code="unavailable", type="server_error")
        part = ids[i:i + 3]
        yield ChoiceDelta(index=0, text=tokenizer.decode(part), token_ids=part, logprobs=[0.0] * len(part),
                          finish_reason="stop" if i + 3 >= len(ids) else None, policy_version=0)


# The class as written in app.py, without the wrapper @serve.ingress puts around it.
POLICY_SERVER = next(c for c in PolicyServer.func_or_class.__mro__ if "check_request" in vars(c))


def policy(tokenizer, fail_after: int | None = None, completion: str = COMPLETION):
    """The policy server's own request handling (model check, chat template, sampling defaults, length check),
    without Serve or an engine: only `run`, which generates, is scripted to answer `completion`."""
    server = object.__new__(POLICY_SERVER)  # its __init__ starts an engine inside a Serve replica
    server.model_name, server.tokenizer, server.max_model_len = "tiny", tokenizer, 512
    server.defaults, server.rollout_sampling, server.adapters = {"temperature": 0.7}, {}, AdapterRoutes("tiny", False)
    server.taught, server.tool_format, server.engine = {}, "hermes", SimpleNamespace(policy_version=0, broken=None)
    server.run = partial(scripted_run, tokenizer, completion, fail_after)
    return server


async def serve(server, http_request: httpx.Request) -> httpx.Response:
    """POST /v1/responses, through the real create_response, as the app's route answers it."""
    try:
        body = ResponsesRequest.model_validate_json(http_request.content)
        out = await create_response(server, body, CallTrace(None, None))
    except ApiError as e:
        out = error_response(e)
    if isinstance(out, dict):
        return httpx.Response(200, json=out)
    if hasattr(out, "body_iterator"):  # a stream: every frame the server would send
        body = "".join([chunk async for chunk in out.body_iterator]).encode()
    else:
        body = out.body
    return httpx.Response(out.status_code, content=body, headers={"content-type": out.media_type})


FOUND: list[str] = []  # what answers broke the schema (tests/openai_schema.py)


@pytest.fixture
def client_of(tokenizer):
    def make(**kw):
        handler = lambda http_request: asyncio.run(serve(policy(tokenizer, **kw), http_request))  # noqa: E731
        transport = CheckedTransport(FOUND, httpx.MockTransport(handler))
        return openai.OpenAI(api_key="x", base_url="http://policy/v1", max_retries=0,
                             http_client=httpx.Client(transport=transport))

    yield make
    found, FOUND[:] = list(FOUND), []
    assert not found, "answers that break the Responses API schema:\n" + "\n".join(found)


def test_client_parses_a_response(client_of):
    resp = client_of().responses.create(model="tiny", input="2?", tools=[ADD])
    assert resp.output_text == "Checking." and resp.output[1].name == "add"
    assert resp.usage.output_tokens == len(resp.model_extra["token_ids"]) > 0
    assert resp.usage.input_tokens == len(resp.model_extra["prompt_token_ids"])
    assert resp.temperature == 0.7  # the server's default, as sampled: the request set none


def test_client_stream_accumulates_to_the_same_response(client_of):
    with client_of().responses.stream(model="tiny", input="2?", tools=[ADD]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert final.output_text == "Checking."
    assert (final.output[1].name, json.loads(final.output[1].arguments)) == ("add", {"a": 2})


def test_a_stream_that_fails_part_way_raises_in_the_client(client_of):
    """The headers are sent before generation fails: the failure comes in-band, as response.failed (status
    "failed") and an error event, which the openai client raises with the server's message."""
    kinds = []
    with pytest.raises(openai.APIError, match="the generation was cut short"):
        for event in client_of(fail_after=3).responses.create(model="tiny", input="2?", stream=True):
            kinds.append(event.type)
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.failed"
    assert event.response.status == "failed" and event.response.error.code == "unavailable"
    assert "response.output_text.delta" in kinds  # it failed part way, after text went out


def test_requests_the_server_cannot_serve_are_refused(client_of):
    with pytest.raises(openai.UnprocessableEntityError, match="presence_penalty is not supported"):
        client_of().responses.create(model="tiny", input="2?", extra_body={"presence_penalty": 0.5})
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client_of().responses.create(model="gpt-4o", input="2?")


def test_parallel_tool_calls_false_keeps_the_first_call(client_of):
    """At most one call per turn, as OpenAI means parallel_tool_calls: false (vLLM keeps the first), streamed or not."""
    two = COMPLETION + '\n<tool_call>\n{"name": "add", "arguments": {"a": 3}}\n</tool_call>'
    for parallel, arguments in ((None, [{"a": 2}, {"a": 3}]), (False, [{"a": 2}])):
        kw = {} if parallel is None else {"parallel_tool_calls": parallel}
        resp = client_of(completion=two).responses.create(model="tiny", input="2?", tools=[ADD], **kw)
        with client_of(completion=two).responses.stream(model="tiny", input="2?", tools=[ADD], **kw) as stream:
            streamed = stream.get_final_response()
        for r in (resp, streamed):
            assert r.output_text == "Checking." and r.parallel_tool_calls is (parallel is None)
            assert [json.loads(o.arguments) for o in r.output if o.type == "function_call"] == arguments


def test_a_developer_message_is_rendered_as_the_system_turn(client_of, tokenizer):
    """The tiny model's template knows no developer role: the message OpenAI's clients send for system is one."""
    resp = client_of().responses.create(model="tiny", tools=[ADD], input=[
        {"role": "developer", "content": "Use tools."}, {"role": "user", "content": "2?"}])
    prompt = tokenizer.decode(resp.model_extra["prompt_token_ids"])
    assert prompt.startswith("<|im_start|>system\nUse tools.\n\n# Tools\n") and "developer" not in prompt
