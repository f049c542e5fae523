"""Tracing: the embedded tracer, the OpenTelemetry exporter and the OTLP receiver give the same Spans."""

from __future__ import annotations

import asyncio
import base64
import json
import random
from decimal import Decimal

import pytest
from google.protobuf import json_format
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode
from starlette.requests import Request

from lightning_ray.tracing import (
    emit_exception, emit_message, emit_object, emit_reward, emit_tool, semconv, span, trace_attempt,
)
from lightning_ray.serving.http import trace_ids
from lightning_ray.tracing.agent_header import AgentHeader, AgentSpans
from lightning_ray.tracing.otel import _use_system_ids, setup_otel, span_from_otel
from lightning_ray.tracing.otlp import JSON, PROTOBUF, OtlpDecodeError, UnsupportedContentType, spans_from_otlp


def agent(question: str) -> int:
    """An ordinary agent using the tracing API: nested spans, tools that work and fail, an exception, a reward."""
    with span("agent", {semconv.AGENT_NAME: "calc", "question": question}) as root:
        with span("plan", {"step": 1, "tags": ["a", "b"], "weights": (0.5, 1), "nested": {"k": [1, {"x": None}]},
                           "price": Decimal("1.5"), "nothing": None}) as plan:
            plan.set_attribute("extra", 1.5)
            plan.add_event("gen_ai.user.message", {"gen_ai.system": "openai", "content": question})
            emit_message("thinking")
        emit_tool("calculator", {"expression": "2+2"}, result=4, call_id="call-1")
        emit_tool("search", {"q": question}, error=RuntimeError("offline"))
        try:
            with span("check", {"agent.name": "checker"}):
                raise ValueError("boom")
        except ValueError as e:
            emit_exception(e)
        emit_object({"answer": 4, "steps": [1, 2]})
        root.add_event("gen_ai.choice", {"index": 0, "finish_reason": "stop",
                                         "message": {"role": "assistant", "content": "4"}})
        emit_reward({"correct": 1.0, "format": 0.5})
    return 4


def run(backend: str, batch_size: int = 512) -> tuple[list, list[int]]:
    received, batches = [], []

    def sink(spans):
        batches.append(len(spans))
        received.extend(spans)

    with trace_attempt("ro-1", "at-1", sink, backend=backend, batch_size=batch_size):
        assert agent("what is 2+2?") == 4
    return received, batches


def normalise(spans) -> list[dict]:
    """Spans with generated ids replaced by their order of appearance and times by checks that they are sane."""
    ids: dict[str, int] = {}
    out = []
    for s in spans:
        assert len(s.trace_id) == 32 and len(s.span_id) == 16 and int(s.trace_id, 16) and int(s.span_id, 16)
        assert s.start_time <= s.end_time
        d = s.model_dump()
        for key in ("trace_id", "span_id", "parent_id"):
            d[key] = None if d[key] is None else ids.setdefault(d[key], len(ids))
        d.pop("start_time"), d.pop("end_time")
        for e in d["events"]:
            assert s.start_time <= e.pop("time") <= s.end_time
            attributes = e["attributes"]
            if semconv.EXCEPTION_STACKTRACE in attributes:  # frames differ by backend; the exception does not
                stack = attributes.pop(semconv.EXCEPTION_STACKTRACE)
                exception = f"{attributes[semconv.EXCEPTION_TYPE]}: {attributes[semconv.EXCEPTION_MESSAGE]}\n"
                assert stack.endswith(exception)
        out.append(d)
    return out


@pytest.fixture(scope="module")
def otel_spans():
    """Every span the global OpenTelemetry provider (the one setup_otel installs) finishes, as the SDK has it."""
    memory = InMemorySpanExporter()
    setup_otel().add_span_processor(SimpleSpanProcessor(memory))
    yield memory
    memory.clear()


def test_embedded_and_otel_backends_give_the_same_spans(otel_spans):
    embedded, otel = normalise(run("embedded")[0]), normalise(run("otel")[0])
    assert embedded == otel

    by_name = {s["name"]: s for s in embedded}
    assert [s["name"] for s in embedded] == [
        "message", "plan", "execute_tool calculator", "execute_tool search", "check", "exception", "object",
        "reward", "agent"]
    assert {(s["rollout_id"], s["attempt_id"]) for s in embedded} == {("ro-1", "at-1")}
    root = by_name["agent"]
    assert root["parent_id"] is None and len({s["trace_id"] for s in embedded}) == 1
    assert by_name["message"]["parent_id"] == by_name["plan"]["span_id"]
    assert all(s["parent_id"] == root["span_id"] for s in embedded if s["name"] not in ("agent", "message"))

    plan = by_name["plan"]["attributes"]  # values cleaned as the OpenTelemetry SDK cleans them, sequences as lists
    assert plan == {"step": 1, "tags": ["a", "b"], "weights": [0.5, 1], "nested": {"k": [1, {"x": None}]},
                    "price": "1.5", "nothing": None, "extra": 1.5}
    assert by_name["plan"]["events"] == [
        {"name": "gen_ai.user.message", "attributes": {"gen_ai.system": "openai", "content": "what is 2+2?"}}]
    assert root["events"][0]["attributes"]["message"] == {"role": "assistant", "content": "4"}

    ok, failed = by_name["execute_tool calculator"], by_name["execute_tool search"]
    assert (ok["status"], failed["status"]) == ("ok", "error")  # the AIR signal
    assert ok["attributes"] == {semconv.OPERATION: "execute_tool", semconv.TOOL_NAME: "calculator",
                                semconv.TOOL_CALL_ID: "call-1", semconv.TOOL_CALL_ARGUMENTS: '{"expression": "2+2"}',
                                semconv.TOOL_CALL_RESULT: "4"}
    assert failed["status_message"] == "RuntimeError: offline"
    assert failed["attributes"][semconv.ERROR_TYPE] == "RuntimeError"
    assert failed["events"][0]["name"] == semconv.EXCEPTION

    check = by_name["check"]  # an exception leaving a span: status error and OpenTelemetry's exception event
    assert (check["status"], check["status_message"]) == ("error", "ValueError: boom")
    assert check["events"] == [{"name": "exception", "attributes": {
        semconv.EXCEPTION_TYPE: "ValueError", semconv.EXCEPTION_MESSAGE: "boom", semconv.EXCEPTION_ESCAPED: "False"}}]
    assert check["attributes"][semconv.AGENT_NAME] == "checker"  # derived from OpenInference's agent.name
    assert by_name["exception"]["status"] == "error" and by_name["exception"]["events"][0]["name"] == "exception"

    assert by_name["reward"]["attributes"] == {semconv.REWARD_VALUE: 1.0, f"{semconv.REWARD_VALUE}.correct": 1.0,
                                               f"{semconv.REWARD_VALUE}.format": 0.5}
    assert json.loads(by_name["object"]["attributes"][semconv.OBJECT_JSON]) == {"answer": 4, "steps": [1, 2]}
    assert by_name["message"]["attributes"] == {semconv.MESSAGE_TEXT: "thinking"}


def to_otlp_json(request, hex_ids: bool = True) -> bytes:
    """The OTLP JSON encoding of a request: protobuf's JSON mapping with trace/span ids in hex, as the spec says."""
    doc = json_format.MessageToDict(request)
    if hex_ids:
        for rs in doc.get("resourceSpans", []):
            for ss in rs.get("scopeSpans", []):
                for s in ss.get("spans", []):
                    for key in ("traceId", "spanId", "parentSpanId"):
                        if key in s:
                            s[key] = base64.b64decode(s[key]).hex()
    return json.dumps(doc).encode()


def test_otlp_from_the_otel_backend_gives_what_the_sink_got(otel_spans):
    """The receiver proof: what the real OTLP exporter would send for an attempt's SDK spans decodes to exactly the
    spans our in-process exporter delivered for them."""
    otel_spans.clear()
    delivered, _ = run("otel")
    request = encode_spans(otel_spans.get_finished_spans())
    assert spans_from_otlp(request.SerializeToString(), PROTOBUF) == delivered
    assert spans_from_otlp(to_otlp_json(request), JSON) == delivered


def sdk_spans():
    """Real SDK spans with a named resource, GenAI attributes and events, every AnyValue kind, an error status."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({
        "service.name": "calc-agent", semconv.ROLLOUT_ID: "ro-9", semconv.ATTEMPT_ID: "at-9", "host.name": "x"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("invoke_agent", attributes={"gen_ai.operation.name": "invoke_agent",
                                                                  "agent_name": "solver"}):
        with tracer.start_as_current_span("chat policy", attributes={
            semconv.MODEL: "policy", "gen_ai.usage.input_tokens": 7, "gen_ai.request.temperature": 0.7,
            "gen_ai.response.finish_reasons": ["stop"], semconv.PROMPT_TOKEN_IDS: list(range(700)),
            semconv.LOGPROBS: [-0.5, 0.0, -1.25], "flags": [True, False], "blob": b"\x00\xff",
            "mixed": [1, "two", 3.0, None], "config": {"depth": 2, "names": ["a"]}, "empty": [],
            semconv.ROLLOUT_ID: "ro-1",
        }) as s:
            s.add_event("gen_ai.user.message", {"content": "2+2?"})
            s.add_event("gen_ai.choice", {"index": 0, "message": {"role": "assistant", "content": "4"}})
            s.set_status(Status(StatusCode.ERROR, "rate limited"))
    return memory.get_finished_spans()


def test_otlp_protobuf_and_json_equal_the_exporter():
    readable = sdk_spans()
    expected = [span_from_otel(s) for s in readable]
    request = encode_spans(readable)
    assert spans_from_otlp(request.SerializeToString(), PROTOBUF) == expected
    assert spans_from_otlp(to_otlp_json(request), "application/json; charset=utf-8") == expected
    assert spans_from_otlp(json_format.MessageToJson(request).encode(), JSON) == expected  # base64 ids, enum names

    chat, agent_span = expected
    assert chat.parent_id == agent_span.span_id and chat.trace_id == agent_span.trace_id
    assert (chat.rollout_id, chat.attempt_id) == ("ro-1", "at-9")  # span attribute first, then the resource
    assert (agent_span.rollout_id, agent_span.attempt_id) == ("ro-9", "at-9")
    assert agent_span.attributes == {"service.name": "calc-agent", "gen_ai.operation.name": "invoke_agent",
                                     "agent_name": "solver", semconv.AGENT_NAME: "solver"}
    assert chat.attributes[semconv.PROMPT_TOKEN_IDS] == list(range(700))
    assert chat.attributes["mixed"] == [1, "two", 3.0, None] and chat.attributes["blob"] == b"\x00\xff"
    assert chat.attributes["config"] == {"depth": 2, "names": ["a"]} and chat.attributes["empty"] == []
    assert (chat.status, chat.status_message) == ("error", "rate limited")
    assert [e.name for e in chat.events] == ["gen_ai.user.message", "gen_ai.choice"]
    assert chat.events[1].attributes == {"index": 0, "message": {"role": "assistant", "content": "4"}}
    assert semconv.ROLLOUT_ID not in chat.attributes and "host.name" not in chat.attributes


ARRAYS = {  # long arrays take the protobuf decoder's byte-level fast paths, or must fall back from them exactly
    "ints": list(range(-20, 20)) + [2**63 - 1, -2**63], "doubles": [0.0, -0.5, float("inf"), 1e308, 5e-324] * 4,
    "ints then a string": list(range(20)) + ["x"], "ints then None": list(range(20)) + [None],
    "None then ints": [None] + list(range(20)), "doubles then an int": [1.5] * 20 + [2], "bools": [True, False] * 10,
    "strings": ["a", ""] * 10, "bytes": [b"x", b""] * 10, "nested": [[1, 2], {"k": 0}] * 10, "short": [0, 1],
}


def test_otlp_protobuf_arrays_decode_exactly():
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    with provider.get_tracer("test").start_as_current_span("arrays", attributes=ARRAYS):
        pass
    readable = memory.get_finished_spans()
    decoded = spans_from_otlp(encode_spans(readable).SerializeToString(), PROTOBUF)[0].attributes
    assert decoded == ARRAYS == span_from_otel(readable[0]).attributes


def test_otlp_rejects_malformed_bodies():
    body = encode_spans(sdk_spans()).SerializeToString()
    with pytest.raises(OtlpDecodeError, match="protobuf"):
        spans_from_otlp(body[:-5], PROTOBUF)
    with pytest.raises(OtlpDecodeError, match="not valid JSON"):
        spans_from_otlp(b'{"resourceSpans": [', JSON)
    with pytest.raises(OtlpDecodeError, match="object with resourceSpans"):
        spans_from_otlp(b"[1, 2]", JSON)
    with pytest.raises(UnsupportedContentType, match="text/plain"):
        spans_from_otlp(body, "text/plain")
    assert issubclass(UnsupportedContentType, ValueError)

    def json_span(**fields):
        span = {"traceId": "ab" * 16, "spanId": "cd" * 8, "name": "s", "startTimeUnixNano": "2", "endTimeUnixNano": "3",
                **fields}
        return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}).encode()

    assert spans_from_otlp(json_span(), JSON)[0].span_id == "cd" * 8
    for fields, message in [
        ({"spanId": ""}, r"resourceSpans\[0\].scopeSpans\[0\].spans\[0\]: spanId is missing"),
        ({"traceId": "00" * 16}, "traceId must be 16 bytes, not all zero"),
        ({"spanId": "00" * 8}, "spanId must be 8 bytes, not all zero"),
        ({"parentSpanId": "00" * 4}, "parentSpanId must be 8 bytes"),
        # not an OverflowError (a 500) converting to seconds
        ({"startTimeUnixNano": "1" + "0" * 400, "endTimeUnixNano": "2" + "0" * 400},
         "startTimeUnixNano is out of range"),
        ({"endTimeUnixNano": "1" + "0" * 400}, "endTimeUnixNano is out of range"),
        ({"events": [{"name": "e", "timeUnixNano": "1" + "0" * 400}]}, "timeUnixNano is out of range"),
        ({"endTimeUnixNano": "1"}, "endTimeUnixNano is before startTimeUnixNano"),
        ({"status": {"code": 7}}, "unknown status code 7"),
        ({"attributes": [{"key": "k", "value": {"intValue": "x"}}]}, "malformed"),
        ({"attributes": [{"key": "k", "value": {"fooValue": 1}}]}, "unknown AnyValue kind"),
    ]:
        with pytest.raises(OtlpDecodeError, match=message):
            spans_from_otlp(json_span(**fields), JSON)


def test_otlp_an_all_zero_parent_is_no_parent():
    """As the OTel Collector reads it: some exporters send a root's parentSpanId as zeros."""
    request = encode_spans(sdk_spans())
    spans = request.resource_spans[0].scope_spans[0].spans
    root = next(s for s in spans if not s.parent_span_id)
    root.parent_span_id = bytes(8)
    decoded = spans_from_otlp(request.SerializeToString(), PROTOBUF)
    assert [s.parent_id for s in decoded] == [spans[0].parent_span_id.hex(), None]
    assert spans_from_otlp(to_otlp_json(request), JSON) == decoded  # "0000000000000000"
    assert spans_from_otlp(json_format.MessageToJson(request).encode(), JSON) == decoded  # base64


def test_otel_span_ids_do_not_follow_a_seeded_random(otel_spans):
    """An agent seeding `random` per task must not repeat its span ids: the store keeps one span per
    (rollout_id, span_id) and would drop a retried attempt's spans as duplicates."""
    def ids(tracer=None) -> set[str]:
        random.seed(7)
        if tracer is not None:
            with tracer.start_as_current_span("s") as s:
                return {f"{s.get_span_context().span_id:016x}"}
        got = []
        with trace_attempt("ro-5", "at-5", got.extend, backend="otel"):
            with span("step"):
                emit_reward(1.0)
        return {s.span_id for s in got} | {s.trace_id for s in got}

    assert not ids() & ids()
    provider = TracerProvider()  # a framework's provider, which setup_otel reuses, with a tracer made before
    tracer = provider.get_tracer("framework")
    assert ids(tracer) == ids(tracer)  # the SDK's default generator
    _use_system_ids(provider)
    assert not ids(tracer) & ids(tracer) and not ids(provider.get_tracer("later")) & ids(tracer)


@pytest.mark.parametrize("backend", ["embedded", "otel"])
def test_a_span_closed_in_another_context_still_ends(backend):
    """An async generator the agent leaves early is closed by the event loop in a task of its own."""
    async def stream():
        with span("llm stream"):
            for i in range(10):
                yield i

    async def agent():
        async for chunk in stream():
            if chunk == 2:
                break
        await asyncio.sleep(0.05)  # the loop's asyncgen finalizer closes stream() meanwhile

    got = []
    with trace_attempt("ro-6", "at-6", got.extend, backend=backend):
        asyncio.run(agent())
    assert [s.name for s in got] == ["llm stream"]


def test_the_agent_header_carries_any_name_to_the_server():
    spans, provider = AgentSpans(), TracerProvider()
    provider.add_span_processor(spans)
    header, tracer = AgentHeader(spans), provider.get_tracer("t")
    for name in ["coder", "Research Agent", "a+b/c=d", "50%", " padded ", "new\nline", "Rédacteur", "规划者"]:
        with tracer.start_as_current_span("invoke_agent", attributes={semconv.AGENT_NAME: name}):
            carrier: dict = {}
            header.inject(carrier)
        value = carrier[semconv.AGENT_HEADER]
        assert value.isascii() and value.isprintable() and value == value.strip()  # what HTTP carries unchanged
        assert (value == name) == (name in ("coder", "Research Agent", "a+b/c=d"))  # ASCII names as they are
        request = Request({"type": "http", "headers": [(semconv.AGENT_HEADER.encode(), value.encode("latin-1"))]})
        assert trace_ids(request).agent == name


def test_emitters_and_spans_are_noops_outside_an_attempt(otel_spans):
    otel_spans.clear()
    assert agent("no attempt") == 4  # span(...), every emitter, set_attribute/add_event on the spans: nothing raised
    assert otel_spans.get_finished_spans() == ()


def test_spans_reach_the_sink_in_batches():
    spans, batches = run("embedded", batch_size=4)
    assert batches == [4, 4, 1] and len(spans) == 9


def test_a_failing_sink_loses_no_spans_mid_run_and_fails_the_final_flush():
    calls, received = [], []

    def flaky(spans):
        calls.append(len(spans))
        if len(calls) == 1:
            raise ConnectionError("store restarting")
        received.extend(spans)

    with trace_attempt("ro-3", "at-3", flaky, batch_size=4):
        assert agent("q") == 4  # the agent never sees the failure
    # the kept 4 go again with the next 4, a batch's size at a time
    assert calls == [4, 4, 4, 1] and len({s.span_id for s in received}) == 9

    def down(spans):
        raise ConnectionError("store down")

    with pytest.raises(ConnectionError, match="store down"):
        with trace_attempt("ro-4", "at-4", down):
            emit_reward(1.0)


def test_framework_otel_spans_join_an_embedded_attempt(otel_spans):
    """An agent framework's own OpenTelemetry spans, started inside the attempt, are stamped and delivered with it."""
    received = []
    with trace_attempt("ro-2", "at-2", received.extend):
        with trace.get_tracer("some.framework").start_as_current_span("framework step", attributes={"k": 1}):
            emit_reward(0.25)
    assert sorted(s.name for s in received) == ["framework step", "reward"]
    assert {(s.rollout_id, s.attempt_id) for s in received} == {("ro-2", "at-2")}
    assert next(s for s in received if s.name == "reward").attributes == {semconv.REWARD_VALUE: 0.25}


def test_a_sync_tool_run_in_an_executor_stays_in_the_attempt():
    """AutoGen's FunctionTool runs a sync tool with loop.run_in_executor, which gives the pool thread none of the
    caller's context: its emit_tool (AIR's tool status) and spans were dropped, no error said."""
    import asyncio

    def calculator(expression: str) -> str:
        with span("calculator internals"):
            emit_tool("calculator", {"expression": expression}, "5")
        return "5"

    async def agent():
        return await asyncio.get_running_loop().run_in_executor(None, calculator, "2+3")

    received = []
    with trace_attempt("ro-x", "at-x", received.extend):
        assert asyncio.run(agent()) == "5"
    assert sorted(s.name for s in received) == ["calculator internals", "execute_tool calculator"]
    assert {(s.rollout_id, s.attempt_id) for s in received} == {("ro-x", "at-x")}
