"""The Responses API mapping: requests to chat, completions to Response objects and stream events, checked against
the official openai client's own types and, through a mock HTTP transport, its parser and stream accumulator."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from lightning_ray.serving.responses import ResponseEventStream, ResponsesRequest, to_chat, to_response
from lightning_ray.serving.sse import frame
from lightning_ray.serving.tools import ToolCallStreamParser, parse_tool_calls

ADD = {"type": "function", "name": "add", "description": "Add", "strict": True,
       "parameters": {"type": "object", "properties": {"a": {"type": "number"}}, "required": ["a"]}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)


def request(**kw) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "tiny", "input": "hi", **kw})


# --- the request --------------------------------------------------------------------------------------------------

def test_request_ignores_unknown_fields_and_keeps_known_ones():
    req = request(tools=[ADD], tool_choice="required", max_output_tokens=64, store=True, metadata={"k": "v"},
                  prompt_cache_key="x", include=["message.output_text.logprobs"], text={"format": {"type": "text"}})
    assert req.max_output_tokens == 64 and req.tools == [ADD] and not hasattr(req, "prompt_cache_key")


@pytest.mark.parametrize("fields, message", [
    ({"previous_response_id": "resp_1"}, "previous_response_id is not supported"),
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
    body = to_response(req, content="5", tool_calls=[], input_tokens=7, output_tokens=2)
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
    body = to_response(req, content="Let me add.", tool_calls=[CALL], input_tokens=3, output_tokens=9)
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
    only_calls = Response.model_validate(to_response(request(), content=None, tool_calls=[CALL, CALL],
                                                     input_tokens=1, output_tokens=1))
    assert [o.type for o in only_calls.output] == ["function_call", "function_call"]
    empty = Response.model_validate(to_response(request(), content=None, tool_calls=[], input_tokens=1,
                                                output_tokens=0))
    assert [o.type for o in empty.output] == ["message"] and empty.output_text == ""


def test_length_finish_is_incomplete():
    resp = Response.model_validate(to_response(request(max_output_tokens=4), content="abc", tool_calls=[],
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
    return events + stream.finish(input_tokens=5, output_tokens=len(text), finish_reason=finish_reason)


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
    whole = Response.model_validate(to_response(req, content=content, tool_calls=calls, input_tokens=5,
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
    events += stream.finish(input_tokens=1, output_tokens=3)
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


# --- through the official client ----------------------------------------------------------------------------------

COMPLETION = "Checking.\n<tool_call>\n" + '{"name": "add", "arguments": {"a": 2}}' + "\n</tool_call>"


def _fake_server(http_request: httpx.Request) -> httpx.Response:
    """/v1/responses answered the way the policy server is meant to: parse, map to chat, answer with COMPLETION."""
    req = ResponsesRequest.model_validate(json.loads(http_request.content))
    messages, _, _ = to_chat(req)
    assert messages[-1]["role"] == "user"
    if not req.stream:
        content, calls = parse_tool_calls(COMPLETION)
        body = to_response(req, content=content, tool_calls=calls, input_tokens=4, output_tokens=11)
        return httpx.Response(200, json=body)
    sse = "".join(frame(e, e["type"]) for e in stream_events(req, COMPLETION, chunk=5))
    return httpx.Response(200, content=sse.encode(), headers={"content-type": "text/event-stream"})


@pytest.fixture
def client():
    return openai.OpenAI(api_key="x", base_url="http://policy/v1",
                         http_client=httpx.Client(transport=httpx.MockTransport(_fake_server)))


def test_client_parses_a_response(client):
    resp = client.responses.create(model="tiny", input="2?", tools=[ADD])
    assert resp.output_text == "Checking." and resp.output[1].name == "add" and resp.usage.total_tokens == 15


def test_client_stream_accumulates_to_the_same_response(client):
    with client.responses.stream(model="tiny", input="2?", tools=[ADD]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert final.output_text == "Checking."
    assert (final.output[1].name, json.loads(final.output[1].arguments)) == ("add", {"a": 2})
