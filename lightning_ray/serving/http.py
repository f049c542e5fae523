"""HTTP plumbing shared by every endpoint: per-rollout routing, the API key, body size, OpenAI error bodies.

/rollouts/{rollout_id}/attempts/{attempt_id}/v1/... is rewritten to /v1/... with the ids moved into the
X-Rollout-Id / X-Attempt-Id headers, so each endpoint is written once and agents may use either form.
A W3C `traceparent` header (what OpenTelemetry's HTTP client instrumentation sends) names the agent's span the call
was made under: the server's LLM span takes it as parent, so it nests under the agent's spans in the store.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
from typing import NamedTuple
from urllib.parse import unquote

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from opentelemetry.trace import get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.exceptions import HTTPException as StarletteHTTPException

from lightning_ray import auth
from lightning_ray.tracing import semconv

logger = logging.getLogger(__name__)

ROLLOUT_HEADER, ATTEMPT_HEADER = "x-rollout-id", "x-attempt-id"
REPLICA_HEADER = "x-lightning-ray-replica"  # on every response: which replica served it
_ROLLOUT_PATH = re.compile(r"^/rollouts/(?P<rollout>[^/]+)/attempts/(?P<attempt>[^/]+)(?P<rest>/v1/.*)$")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type


def answer(result):
    """An endpoint's result as its response: an answer (a dict of JSON types) straight to JSON, with no pass of
    FastAPI's jsonable_encoder over it first (a few percent of a call's CPU); a response (a stream) as it is."""
    return JSONResponse(result) if isinstance(result, dict) else result


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None):
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status,
                        headers={"retry-after": "1"} if e.status == 429 else None)


_W3C = TraceContextTextMapPropagator()


class CallTrace(NamedTuple):
    """Where a call belongs: its rollout and attempt, the client's trace and span it was made under, and the agent
    it names (serving/adapters.py)."""

    rollout_id: str | None
    attempt_id: str | None
    trace_id: str | None = None
    parent_id: str | None = None
    agent: str | None = None


def trace_ids(request: Request) -> CallTrace:
    # OpenTelemetry's own W3C parser: a malformed traceparent gives an invalid context, ignored as W3C asks
    parent = get_current_span(_W3C.extract(request.headers)).get_span_context()
    trace_id, parent_id = (f"{parent.trace_id:032x}", f"{parent.span_id:016x}") if parent.is_valid else (None, None)
    agent = request.headers.get(semconv.AGENT_HEADER)  # percent-encoded UTF-8 (tracing/agent_header.py)
    return CallTrace(request.headers.get(ROLLOUT_HEADER), request.headers.get(ATTEMPT_HEADER), trace_id, parent_id,
                     unquote(agent) if agent else None)


def rollout_of(scope: dict) -> str | None:
    """The rollout a raw ASGI request belongs to (the path form wins, as in the middleware); the sticky router's key."""
    if m := _ROLLOUT_PATH.match(scope.get("path", "")):
        return m["rollout"]
    value = dict(scope.get("headers", ())).get(ROLLOUT_HEADER.encode())
    return value.decode() if value else None


class PolicyMiddleware:
    """Pure ASGI middleware (streaming-safe). Settings come from app.state: api_key, max_request_bytes, replica_id,
    agent_routes (the (method, path)s an agent's own key may call: lightning_ray/auth.py)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope["app"].state
        headers = dict(scope["headers"])
        if replica := getattr(state, "replica_id", None):
            send = _with_header(send, REPLICA_HEADER.encode(), replica.encode())
        if m := _ROLLOUT_PATH.match(scope["path"]):
            scope = dict(scope, path=m["rest"], raw_path=m["rest"].encode(), headers=[
                *[(k, v) for k, v in scope["headers"] if k not in (ROLLOUT_HEADER.encode(), ATTEMPT_HEADER.encode())],
                (ROLLOUT_HEADER.encode(), m["rollout"].encode()), (ATTEMPT_HEADER.encode(), m["attempt"].encode())])
        api_key = getattr(state, "api_key", None)
        # bytes, in constant time: no timing oracle, and a header that is not UTF-8 is just a wrong key
        if api_key and not hmac.compare_digest(headers.get(b"authorization", b""), f"Bearer {api_key}".encode()):
            if (agent := auth.agent_of(api_key, headers.get(b"authorization", b""))) is None:
                return await _send(send, ApiError(401, "invalid or missing API key (Authorization: Bearer <key>)",
                                                  code="invalid_api_key"))
            if (denied := _agent_denied(scope, agent, getattr(state, "agent_routes", ()))) is not None:
                return await _send(send, denied)
            scope = _as_agent(scope, agent)
        if limit := getattr(state, "max_request_bytes", None):
            # Counted as it arrives, whatever Content-Length says (or a chunked body does not): the app then reads
            # the body from memory, never more than `limit` bytes of it.
            messages = await _read_body(receive, limit, headers.get(b"content-length", b""))
            if messages is None:
                if count := getattr(state, "count_rejected", None):  # the store counts every rejected input
                    count("request_too_large")
                return await _send(send, ApiError(413, f"request body exceeds the limit of {limit} bytes",
                                                  code="request_too_large"))
            receive = _replay(messages, receive)
        await self.app(scope, receive, send)


def _agent_denied(scope: dict, agent: tuple[str, str], routes) -> ApiError | None:
    """Why an agent's key may not make this request: only the app's agent routes (app.state.agent_routes), and only
    for the attempt the key was minted for."""
    method, path = scope["method"], scope["path"].removeprefix(scope.get("root_path", ""))
    if (matched := next((r for r in scope["app"].routes
                         if getattr(r, "path_regex", None) and r.path_regex.match(path)), None)) is None:
        return ApiError(404, f"no such path: {path} (an agent's base URL ends in /v1: its client adds the rest)",
                        code="not_found")
    if (method, matched.path) not in routes:  # (the route's template: /v1/responses/{response_id})
        return ApiError(403, f"an agent's key cannot call {method} {path}: it reaches the policy and its own "
                             f"attempt's spans only", code="permission_denied")
    named = dict(scope["headers"])
    for header, value in zip((ROLLOUT_HEADER, ATTEMPT_HEADER), agent):
        if named.get(header.encode(), value.encode()) != value.encode():
            return ApiError(403, f"this key is rollout {agent[0]}'s, attempt {agent[1]}'s: it cannot call for "
                                 f"another", code="permission_denied")
    return None


def _as_agent(scope: dict, agent: tuple[str, str]) -> dict:
    """The request as its key's attempt's (the ids filled in where it named none); request.state.agent names it."""
    ids = (ROLLOUT_HEADER.encode(), ATTEMPT_HEADER.encode())
    return dict(scope, headers=[*[(k, v) for k, v in scope["headers"] if k not in ids],
                                *zip(ids, (a.encode() for a in agent))],
                state={**scope.get("state", {}), "agent": agent})


async def _read_body(receive, limit: int, content_length: bytes) -> list[dict] | None:
    """The messages to hand the app: the whole body in one, or the disconnect of a client that went away while
    sending; None as soon as the body is known to pass `limit` bytes."""
    if content_length.isdigit() and int(content_length) > limit:
        return None
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return [message]
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            return None
        if not message.get("more_body", False):
            return [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]


def _replay(messages: list[dict], receive):
    """An ASGI receive that gives the app the messages already read, then the client's later ones (disconnects)."""
    pending = list(messages)

    async def receiving():
        return pending.pop(0) if pending else await receive()

    return receiving


def _with_header(send, name: bytes, value: bytes):
    async def sending(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), (name, value)]}
        await send(message)

    return sending


async def _send(send, e: ApiError) -> None:
    body = json.dumps(error_body(e.message, e.type, e.param, e.code)).encode()
    await send({"type": "http.response.start", "status": e.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def install(app: FastAPI) -> None:
    app.add_middleware(PolicyMiddleware)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        if count := getattr(request.app.state, "count_rejected", None):
            count("invalid_request")
        err = e.errors()[0]
        if err["type"] == "json_invalid":  # loc: ("body", the character where parsing failed)
            return error_response(ApiError(400, f"the body is not valid JSON: {err.get('ctx', {}).get('error', '')} "
                                                f"(at character {err['loc'][-1]})"))
        if param := ".".join(str(p) for p in err["loc"] if p != "body"):
            return error_response(ApiError(400, f"{param}: {err['msg']}", param=param))
        message = err["msg"].removeprefix("Value error, ")  # a check across fields (a model validator's)
        return error_response(ApiError(400, message, param=_named_param(message)))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        return error_response(ApiError(e.status_code, str(e.detail), code=str(e.status_code)))

    @app.exception_handler(ValueError)
    async def _value(_: Request, e: ValueError):
        return error_response(ApiError(400, str(e), param=_named_param(str(e))))

    @app.exception_handler(Exception)
    async def _crash(_: Request, e: Exception):
        logger.exception("request failed")
        return error_response(ApiError(500, f"internal error: {type(e).__name__}", type="server_error"))


def _named_param(message: str) -> str | None:
    """The param an error's message starts by naming ("tool_choice: ..."), if it does."""
    head, _, rest = message.partition(": ")
    return head if rest and " " not in head else None
