"""The OpenAI Responses API (POST /v1/responses, the OpenAI Agents SDK's default) served on top of chat.

A request becomes chat messages + chat tools (to_chat); the completion, split by tools.parse_tool_calls, becomes a
Response object (to_response) or, streamed, the SSE event sequence (ResponseEventStream). The server is stateless:
the client sends the whole conversation every time, so previous_response_id and conversation are rejected.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lightning_ray.serving.chat import enforce_tool_choice, part_text, template_messages
from lightning_ray.serving.decoding import collect_all
from lightning_ray.serving.engines import SamplingParams
from lightning_ray.serving.http import ApiError, CallTrace
from lightning_ray.serving.schemas import TextFormat
from lightning_ray.serving.sse import sse_response
from lightning_ray.serving.tools import ToolCallStreamParser, ToolStreamDelta, parse_tool_calls, resolve_tool_choice


class ResponseText(BaseModel):
    model_config = ConfigDict(extra="allow")  # verbosity, ...: echoed back
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # the SDK sends fields we have no use for (prompt_cache_key, ...)
    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None  # flat function tools: {"type": "function", "name", "parameters", ...}
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)  # only 0 is served (server.check_request)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    max_output_tokens: int | None = Field(None, gt=0)
    max_tool_calls: int | None = Field(None, gt=0)  # a limit on built-in tools, which this server has none of: echoed
    stream: bool = False
    background: bool | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    store: bool | None = None  # accepted, but nothing is stored
    metadata: dict[str, str] | None = None
    text: ResponseText | None = None  # text.format: JSON by constrained decoding, as chat's response_format
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    safety_identifier: str | None = None  # echoed
    prompt_cache_key: str | None = None  # echoed (the engine's prefix cache needs no key)
    include: list[str] | None = None

    @field_validator("tools")
    @classmethod
    def _function_tools_only(cls, tools):
        for i, tool in enumerate(tools or []):
            if tool.get("type") != "function":
                raise ValueError(f"tools[{i}]: only function tools are supported, not {tool.get('type')!r}")
            if not isinstance(tool.get("name"), str) or not tool["name"]:
                raise ValueError(f"tools[{i}]: a function tool needs a name")
        return tools

    @model_validator(mode="after")
    def _stateless(self):
        for name in ("previous_response_id", "conversation"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported: this server keeps no state; send the whole "
                                 "conversation as `input`")
        if self.background:
            raise ValueError("background is not supported: this server keeps no state to poll later")
        return self


def to_chat(req: ResponsesRequest) -> tuple[list[dict], list[dict] | None, str | dict | None]:
    """(chat messages, chat tools, chat tool_choice) for a Responses request. Raises ValueError on unsupported input.

    A function_call item joins the assistant message just before it, so that text + calls the model produced in
    one turn render as that one turn again.
    """
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        kind, where = item.get("type", "message"), f"input[{i}]"
        if kind == "message":
            if item.get("role") not in ("user", "system", "developer", "assistant"):
                raise ValueError(f"{where}: role must be user, system, developer or assistant")
            messages.append({"role": item["role"], "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            if not item.get("call_id") or not item.get("name"):
                raise ValueError(f"{where}: a function_call needs call_id and name")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not item.get("call_id"):
                raise ValueError(f"{where}: a function_call_output needs call_id")
            output = _text(item.get("output"), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind == "reasoning":
            continue  # this server produces no reasoning items; others' are opaque to our models
        elif kind == "item_reference":
            raise ValueError(f"{where}: item_reference is not supported: this server keeps no state")
        else:
            raise ValueError(f"{where}: input item type {kind!r} is not supported")
    tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in req.tools or []]
    return messages, tools or None, _chat_tool_choice(req.tool_choice)


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if (text := part_text(part, f"{where}[{j}]")) is None:
            kind = part.get("type") if isinstance(part, dict) else None
            raise ValueError(f"{where}[{j}]: content part type {kind!r} is not supported (text only)")
        texts.append(text)
    return "\n".join(texts)


def _chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ValueError("tool_choice: expected 'none', 'auto', 'required' or {'type': 'function', 'name': ...}")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, *, item_id: str | None = None, status: str = "completed") -> dict:
    """An assistant message item with one output_text part (no parts while in progress, as the API streams it)."""
    return {"type": "message", "id": item_id or _new_id("msg"), "role": "assistant", "status": status,
            "content": [] if status == "in_progress" else [_text_part(text)]}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(call: dict, *, item_id: str | None = None, status: str = "completed") -> dict:
    """A function_call item from a chat tool call {"id", "function": {"name", "arguments"}}."""
    return {"type": "function_call", "id": item_id or _new_id("fc"), "call_id": call["id"],
            "name": call["function"]["name"], "status": status,
            "arguments": "" if status == "in_progress" else call["function"]["arguments"]}


def to_response(req: ResponsesRequest, *, content: str | None, tool_calls: list[dict], input_tokens: int,
                output_tokens: int, finish_reason: str = "stop", response_id: str | None = None,
                created_at: float | None = None, params: SamplingParams | None = None) -> dict:
    """The Response object for a finished completion, already split into content and chat tool calls."""
    status = "incomplete" if finish_reason == "length" else "completed"
    output = []
    if content or not tool_calls:  # the API always answers with something: an empty message if nothing else
        output.append(message_item(content or "", status=status))
    output += [function_call_item(c) for c in tool_calls]
    return response_object(req, output=output, status=status, usage=response_usage(input_tokens, output_tokens),
                           response_id=response_id, created_at=created_at, params=params)


def response_usage(input_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, "total_tokens": input_tokens + output_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def response_object(req: ResponsesRequest, *, output: list[dict], status: str, usage: dict | None = None,
                    response_id: str | None = None, created_at: float | None = None,
                    params: SamplingParams | None = None, error: dict | None = None) -> dict:
    """A Response object with every field the reference requires, echoing the request's settings as the API does.
    `params`: the sampling used (the request's, else its rollout's or the server's defaults), when known."""
    return {
        "id": response_id or _new_id("resp"), "object": "response", "created_at": int(created_at or time.time()),
        "completed_at": int(time.time()) if status == "completed" else None,
        "status": status, "error": error, "model": req.model, "output": output, "usage": usage,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": None, "reasoning": _reasoning(req.reasoning), "store": False, "background": False,
        "service_tier": "default",
        "temperature": params.temperature if params else 1.0 if req.temperature is None else req.temperature,
        "top_p": params.top_p if params else 1.0 if req.top_p is None else req.top_p,
        "presence_penalty": 0.0, "frequency_penalty": 0.0,  # any other value is refused (check_request)
        "top_logprobs": 0,  # output_text parts carry no logprobs
        "text": _text_config(req.text), "tool_choice": req.tool_choice or "auto",
        "tools": [_function_tool(t) for t in req.tools or []], "truncation": req.truncation or "disabled",
        "user": req.user, "metadata": req.metadata or {}, "safety_identifier": req.safety_identifier,
        "prompt_cache_key": req.prompt_cache_key,
    }


def _function_tool(tool: dict) -> dict:
    """A request's function tool in the documented shape: every field present, null where not given."""
    return {"type": "function", "name": tool["name"], "description": tool.get("description"),
            "parameters": tool.get("parameters"), "strict": tool.get("strict")}


def _text_config(text: ResponseText | None) -> dict:
    """text as the reference echoes it: a json_schema format with all its fields, the schema the one enforced."""
    fmt = text.format if text else None
    if fmt is None or fmt.type != "json_schema":
        out = {"type": fmt.type if fmt else "text"}
    else:
        out = {"type": "json_schema", "name": fmt.name or "response", "description": fmt.description,
               "schema": fmt.constraint, "strict": fmt.strict}
    return {**(text.model_extra if text else {}), "format": out}


def _reasoning(reasoning: dict | None) -> dict | None:
    return {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")} if reasoning else None


class ResponseEventStream:
    """The server-sent events of a streamed response, in the order the Agents SDK and the openai client expect.

    Call start() once, then text(delta) / tool_call(call) (or delta(ToolStreamDelta) for both) as the completion
    arrives, then finish(...). Each returns event dicts (numbered by sequence_number) to send as SSE frames
    (sse.frame). Text after a tool call opens a new message item. The last event, response.completed (or
    response.incomplete when cut by max_output_tokens), carries the whole Response, with the same item ids as the
    events; a stream that fails part way ends with fail(...) instead.
    """

    def __init__(self, req: ResponsesRequest, response_id: str | None = None, created_at: float | None = None,
                 params: SamplingParams | None = None):
        self.req, self.response_id, self.params = req, response_id or _new_id("resp"), params
        self.created_at = created_at or int(time.time())
        self.output: list[dict] = []  # finished items
        self._msg_id: str | None = None  # the message item being streamed, if any
        self._msg_text = ""
        self._seq = 0

    def start(self) -> list[dict]:
        snapshot = self._response(output=[], status="in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def delta(self, d: ToolStreamDelta) -> list[dict]:
        events = self.text(d.content) if d.content else []
        for call in d.tool_calls:
            events += self.tool_call(call)
        return events

    def text(self, delta: str) -> list[dict]:
        events = [] if self._msg_id else self._open_message()
        self._msg_text += delta
        return events + [self._event("response.output_text.delta", **self._where(), content_index=0, delta=delta,
                                     logprobs=[])]

    def tool_call(self, call: dict) -> list[dict]:
        events, index = self._close_message(), len(self.output)
        added = function_call_item(call, status="in_progress")
        done = function_call_item(call, item_id=added["id"])
        self.output.append(done)
        where = {"item_id": done["id"], "output_index": index}
        return events + [
            self._event("response.output_item.added", output_index=index, item=added),
            self._event("response.function_call_arguments.delta", **where, delta=done["arguments"]),
            self._event("response.function_call_arguments.done", **where, arguments=done["arguments"]),
            self._event("response.output_item.done", output_index=index, item=done),
        ]

    def finish(self, *, input_tokens: int, output_tokens: int, finish_reason: str = "stop") -> list[dict]:
        status = "incomplete" if finish_reason == "length" else "completed"
        events = self._open_message() if not self.output and not self._msg_id else []  # never an empty output
        events += self._close_message(status)
        final = self._response(output=self.output, status=status, usage=response_usage(input_tokens, output_tokens))
        return events + [self._event(f"response.{status}", response=final)]

    def fail(self, e: ApiError) -> list[dict]:
        """The end of a stream that failed after its headers went out: response.failed, whose response has status
        "failed" and the error (the items finished so far), then the error event, which the openai client raises."""
        failed = self._response(output=self.output, status="failed",
                                error={"code": e.code or e.type, "message": e.message})
        return [self._event("response.failed", response=failed),
                # code/message/param as the openai package reads them; `error` as the reference nests them
                self._event("error", code=e.code, message=e.message, param=e.param,
                            error={"type": e.type, "code": e.code, "message": e.message, "param": e.param})]

    def _response(self, **fields) -> dict:
        return response_object(self.req, response_id=self.response_id, created_at=self.created_at, params=self.params,
                               **fields)

    def _open_message(self) -> list[dict]:
        self._msg_id, self._msg_text = _new_id("msg"), ""
        return [
            self._event("response.output_item.added", output_index=len(self.output),
                        item=message_item("", item_id=self._msg_id, status="in_progress")),
            self._event("response.content_part.added", **self._where(), content_index=0, part=_text_part("")),
        ]

    def _close_message(self, status: str = "completed") -> list[dict]:
        if not self._msg_id:
            return []
        where, text = self._where(), self._msg_text
        item = message_item(text, item_id=self._msg_id, status=status)
        self.output.append(item)
        self._msg_id = None
        return [
            self._event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]),
            self._event("response.content_part.done", **where, content_index=0, part=_text_part(text)),
            self._event("response.output_item.done", output_index=where["output_index"], item=item),
        ]

    def _where(self) -> dict:
        return {"item_id": self._msg_id, "output_index": len(self.output)}

    def _event(self, type_: str, **fields) -> dict:
        self._seq += 1
        return {"type": type_, "sequence_number": self._seq - 1, **fields}


# ---- the route: POST /v1/responses -----------------------------------------------------------------------------
async def create_response(server, req: ResponsesRequest, trace: CallTrace):
    await server.check_request(req, req.text and req.text.format, "text.format.schema")
    messages, tools, tool_choice = to_chat(req)
    offered = resolve_tool_choice(tool_choice, tools)
    messages = template_messages(messages, server.tokenizer.chat_template)
    prompt_ids, forced = await enforce_tool_choice(server, tool_choice, offered, server.encode_chat(messages, offered),
                                                   trace)
    params, deltas = server.generate("responses", req, trace, [prompt_ids], req.max_output_tokens,
                                     req.max_output_tokens is not None, fmt=forced or (req.text and req.text.format),
                                     conversation=(messages, offered))
    if req.stream:
        events = ResponseEventStream(req, params=params)
        return sse_response(_events(events, deltas, prompt_ids, bool(offered), bool(forced), server.tool_format),
                            done_marker=False, named=True, failed=events.fail)
    [c] = await collect_all(deltas)
    content, calls = parse_tool_calls(c.text, server.tool_format, c.span_id, bool(forced),
                                      req.parallel_tool_calls is not False) if offered else (c.text or None, [])
    out = to_response(req, content=content, tool_calls=calls, input_tokens=len(prompt_ids),
                      output_tokens=len(c.token_ids), finish_reason=c.finish_reason or "stop", params=params)
    return {**out, "prompt_token_ids": prompt_ids, "token_ids": c.token_ids}  # extension fields


async def _events(events: ResponseEventStream, deltas, prompt_ids: list[int], parse_tools: bool, forced: bool,
                  tool_format: str):
    parser, output_tokens, finish = None, 0, "stop"
    for e in events.start():
        yield e
    async for d in deltas:
        parser = parser or ToolCallStreamParser(tool_format, d.span_id, forced,  # its span names its tool calls
                                                events.req.parallel_tool_calls is not False)
        output_tokens, finish = output_tokens + len(d.token_ids), d.finish_reason or finish
        for e in events.delta(parser.feed(d.text)) if parse_tools else events.text(d.text) if d.text else []:
            yield e
    for e in (events.delta(parser.finish()) if parse_tools and parser else []) + events.finish(
            input_tokens=len(prompt_ids), output_tokens=output_tokens, finish_reason=finish):
        yield e
