"""1,000 generated requests — valid, half-valid and junk — against every endpoint: never a 5xx, never a hang,
every answer (streamed ones frame by frame) in the shape our schema of the OpenAI API says, no stream that fails
part way with an in-band error, and the server still answers afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from openai_schema import CheckedTransport, is_error_frame, sse_frames


MODEL = "tiny-calc"
junk = st.recursive(st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=True)
                    | st.text(max_size=20), lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)


def request_strategy(bad: st.SearchStrategy) -> st.SearchStrategy:
    """(path, body) with every field drawn from its valid values or from `bad`."""

    def either(valid):
        return st.one_of(valid, bad)

    message = st.fixed_dictionaries(
        {"role": either(st.sampled_from(["system", "user", "assistant", "tool", "developer"])),
         "content": either(st.text(max_size=40))},
        optional={"tool_call_id": either(st.text(max_size=5)), "tool_calls": either(st.just(
            [{"id": "c", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}]))})
    tool = st.just({"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}})
    model = either(st.sampled_from([MODEL, MODEL, "other"]))
    sampling = {
        "temperature": either(st.floats(0, 2)), "top_p": either(st.floats(0.01, 1)), "n": either(st.integers(1, 3)),
        "seed": either(st.integers(0, 2**31)), "stop": either(st.lists(st.text(max_size=3), max_size=4)),
        "stream": either(st.booleans()), "max_tokens": either(st.integers(1, 6)),
    }
    chat = st.fixed_dictionaries({"model": model, "messages": either(st.lists(message, min_size=1, max_size=3))},
                                 optional={**sampling, "tools": either(st.lists(tool, max_size=2)),
                                           "tool_choice": either(st.sampled_from(["auto", "none", "required"])),
                                           "logprobs": either(st.booleans()), "top_logprobs": either(st.integers(0, 20)),
                                           "stream_options": either(st.just({"include_usage": True})),
                                           "response_format": either(st.sampled_from([{"type": "text"},
                                                                                       {"type": "json_object"}]))})
    completion = st.fixed_dictionaries(
        {"model": model, "prompt": either(st.text(max_size=30) | st.lists(st.integers(-5, 2000), max_size=8))},
        optional={**sampling, "logprobs": either(st.integers(0, 6)), "echo": either(st.booleans())})
    response = st.fixed_dictionaries(
        {"model": model, "input": either(st.text(max_size=30) | st.lists(message, max_size=2))},
        optional={"instructions": either(st.text(max_size=20)), "max_output_tokens": either(st.integers(1, 6)),
                  "stream": either(st.booleans()), "tools": either(st.just([{"type": "function", "name": "calculator"}]))})
    return st.one_of(st.tuples(st.just("/v1/chat/completions"), chat), st.tuples(st.just("/v1/completions"), completion),
                     st.tuples(st.just("/v1/responses"), response))


def streamed(request: tuple[str, dict]) -> tuple[str, dict]:
    path, body = request
    return path, {**body, "stream": True}


# Some requests use only valid values field by field (they still combine into invalid requests, e.g. a tool
# message without its id); others mix in junk of any JSON type, NaN and Infinity included; a quarter stream.
requests = st.one_of(request_strategy(st.nothing()), request_strategy(junk),
                     st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/responses"]), junk),
                     st.one_of(request_strategy(st.nothing()), request_strategy(junk)).map(streamed))


@pytest.fixture(scope="module")
def url(policy_app):
    with policy_app(engine={"max_model_len": 256}, rollout={"max_tokens": 4}) as app:
        yield app["url"]


def test_no_request_breaks_the_server(url):
    statuses: dict[int, int] = {}
    streams = 0
    found: list[str] = []  # schema violations of the answers (tests/openai_schema.py)
    with httpx.Client(base_url=url, timeout=30, transport=CheckedTransport(found)) as client:

        @settings(max_examples=1000, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(requests)
        # found by this test once: a line separator inside JSON text (SSE lines end at CR / LF only)
        @example(("/v1/responses", {"model": MODEL, "input": "", "instructions": "\x85\u2028", "stream": True}))
        def one(request):
            path, body = request
            found.clear()  # this request's violations only: hypothesis shrinks each failure on its own
            # json.dumps writes NaN/Infinity as Python clients may: the server must reject them cleanly too
            r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (path, body, r.text)
            assert not found, (path, body, found)  # hypothesis shrinks to the smallest request that breaks it
            if r.headers["content-type"].startswith("text/event-stream"):
                nonlocal streams
                streams += 1
                # A 200 whose stream then fails is a 5xx (or a late 4xx) in disguise: what to refuse is refused
                # before the headers go out, and generation does not fail.
                failures = [data for _, data in sse_frames(r.text)
                            if data != "[DONE]" and is_error_frame(json.loads(data))]
                assert not failures, (path, body, failures)

        one()
        ok = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200
    assert sum(statuses.values()) >= 1000 and statuses.get(200, 0) > 100 and statuses.get(400, 0) > 100, statuses
    assert streams > 50, streams  # streaming is fuzzed too (22 streams before a quarter were made to)
