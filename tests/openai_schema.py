"""Conformance of the API's answers to our JSON Schemas of the OpenAI API (tests/schemas/, written from the API
reference): plain bodies whole, streams frame by frame as they arrive, and how a stream starts and ends.

Tests send their requests through `CheckedTransport(found)` (or the async one): the answers reach the client
unchanged, and every violation is appended to `found`, so a test that expects an error still sees it as the client
would. The test modules assert `found` stays empty (a fixture, after each test)."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import httpx
from jsonschema import Draft202012Validator

SCHEMAS = Path(__file__).parent / "schemas"
# endpoint -> (schema file, the definition of a whole answer, the definition of one streamed frame)
ENDPOINTS = {
    "/v1/responses": ("responses.json", "Response", "StreamEvent"),
    "/v1/chat/completions": ("chat_completions.json", "ChatCompletion", "ChatCompletionChunk"),
    "/v1/completions": ("completions.json", "Completion", "Completion"),
    "/v1/embeddings": ("embeddings.json", "Embeddings", "Embeddings"),  # never streamed
}
TERMINAL = {"response.completed", "response.incomplete", "response.failed"}


@cache
def validator(file: str, definition: str | None = None) -> Draft202012Validator:
    schema = json.loads((SCHEMAS / file).read_text())
    Draft202012Validator.check_schema(schema)
    if definition:
        schema = {"$defs": schema["$defs"], "$ref": f"#/$defs/{definition}"}
    return Draft202012Validator(schema)


def violations(file: str, definition: str | None, body) -> list[str]:
    return [f"{definition or file}: {'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
            for e in validator(file, definition).iter_errors(body)]


def endpoint(path: str) -> tuple[str, str, str] | None:
    """The schemas of the endpoint a path reaches (the per-rollout form /rollouts/r/attempts/a/v1/... included)."""
    return next((schemas for suffix, schemas in ENDPOINTS.items() if path.endswith(suffix)), None)


def sse_frames(text: str) -> list[tuple[str | None, str]]:
    """(event name, data) of each whole frame of a server-sent event stream. Lines end at CR, LF or CRLF only, as
    the SSE spec says: str.splitlines() would also break them at U+0085 or U+2028 inside the JSON (found by the fuzz
    test: instructions "\x85")."""
    frames = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in re.split(r"\r\n|\r|\n", block) if ": " in line)
        if "data" in fields:
            frames.append((fields.get("event"), fields["data"]))
    return frames


def is_error_frame(payload) -> bool:
    """An in-band error: what a stream sends when it fails after its headers went out."""
    return isinstance(payload, dict) and (payload.get("type") in ("error", "response.failed") or "error" in payload)


def check_stream(path: str, frames: list[tuple[str | None, str]], ended: bool = True) -> list[str]:
    """Every frame against the schema, and the stream's order: numbered Responses events from response.created to
    a terminal event; chat and completions chunks up to `data: [DONE]`. `ended`: the stream was read to its end."""
    file, _, frame_def = endpoint(path)
    found, payloads, done = [], [], False
    for event, data in frames:
        if done:
            found.append(f"a frame after [DONE]: {data[:80]}")
        if data == "[DONE]":
            done = True
            continue
        payload = json.loads(data)
        payloads.append(payload)
        if frame_def == "StreamEvent":
            found += violations(file, frame_def, payload)
            if event != payload.get("type"):
                found.append(f"SSE event name {event!r} is not the event's type {payload.get('type')!r}")
        else:
            found += violations("error.json", None, payload) if "error" in payload \
                else violations(file, frame_def, payload)
    if frame_def == "StreamEvent" and payloads:
        numbers = [p.get("sequence_number") for p in payloads]
        if numbers != list(range(len(payloads))):
            found.append(f"sequence numbers are not 0, 1, 2, ...: {numbers}")
        if payloads[0].get("type") != "response.created":
            found.append(f"the first event is {payloads[0].get('type')!r}, not response.created")
        last = [p.get("type") for p in payloads if p.get("type") != "error"][-1:]
        if ended and (not last or last[0] not in TERMINAL):
            found.append(f"the stream ended without response.completed / incomplete / failed: {last}")
    elif ended and not done:
        found.append("the stream ended without data: [DONE]")
    return found


class _Conformance:
    """Reads along with the client, then checks what it read."""

    def __init__(self, path: str, response: httpx.Response, found: list[str]):
        self.path, self.status, self.found = path, response.status_code, found
        self.streamed = response.headers.get("content-type", "").startswith("text/event-stream")
        self.body, self.checked = b"", False

    def feed(self, chunk: bytes) -> None:
        self.body += chunk

    def end(self, ended: bool) -> None:
        if self.checked:
            return
        self.checked = True
        schemas, where = endpoint(self.path), f"{self.status} from {self.path}"
        if self.status >= 400:
            self.found += [f"{where}: {v}" for v in violations("error.json", None, json.loads(self.body))]
        elif schemas and self.streamed:
            self.found += [f"{where}: {v}" for v in check_stream(self.path, sse_frames(self.body.decode()), ended)]
        elif schemas:
            self.found += [f"{where}: {v}" for v in violations(schemas[0], schemas[1], json.loads(self.body))]


class _CheckedStream(httpx.SyncByteStream, httpx.AsyncByteStream):
    def __init__(self, inner, conformance: _Conformance):
        self.inner, self.conformance, self.ended = inner, conformance, False

    def __iter__(self):
        for chunk in self.inner:
            self.conformance.feed(chunk)
            yield chunk
        self.ended = True

    async def __aiter__(self):
        async for chunk in self.inner:
            self.conformance.feed(chunk)
            yield chunk
        self.ended = True

    def close(self):
        self.inner.close()
        self.conformance.end(self.ended)

    async def aclose(self):
        await self.inner.aclose()
        self.conformance.end(self.ended)


def _checked(request: httpx.Request, response: httpx.Response, found: list[str]) -> httpx.Response:
    conformance = _Conformance(request.url.path, response, found)
    if hasattr(response, "_content"):  # read already (an answer made in the test, for a mock transport)
        conformance.feed(response.content)
        conformance.end(ended=True)
    else:
        response.stream = _CheckedStream(response.stream, conformance)
    return response


class CheckedTransport(httpx.BaseTransport):
    """Wraps a transport (a real one by default): its answers, checked as the client reads them."""

    def __init__(self, found: list[str], inner: httpx.BaseTransport | None = None):
        self.found, self.inner = found, inner or httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        return _checked(request, response, self.found)

    def close(self):
        self.inner.close()


class AsyncCheckedTransport(httpx.AsyncBaseTransport):
    def __init__(self, found: list[str], inner: httpx.AsyncBaseTransport | None = None):
        self.found, self.inner = found, inner or httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        return _checked(request, response, self.found)

    async def aclose(self):
        await self.inner.aclose()
