"""POST /v1/chat/completions: messages (and tools) through the chat template, choices back as OpenAI objects,
streamed as SSE chunks when asked. Prompt and completion token ids ride along as extension fields."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from lightning_ray.serving.decoding import ChoiceDelta, collect_all, usage
from lightning_ray.serving.http import ApiError, CallTrace
from lightning_ray.serving.schemas import (ChatCompletionRequest, ChatMessage, JsonSchemaFormat, ResponseFormat,
                                           check_schema)
from lightning_ray.serving.sse import sse_response
from lightning_ray.serving.tools import (ToolCallStreamParser, forced_call, forced_opening, parse_tool_calls,
                                         resolve_tool_choice)


# content part type -> the key of its text (an assistant's refusal part is text too)
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def part_text(part: Any, where: str) -> str | None:
    """A text content part's text, None for a part of another type. Raises ValueError (HTTP 400, its param the
    part's field: `where`.text) for a text that is not a string."""
    key = TEXT_PARTS.get(part.get("type")) if isinstance(part, dict) else None
    text = part.get(key, "") if key else None
    if key and not isinstance(text, str):
        raise ValueError(f"{where}.{key}: expected a string, got {json.dumps(text)[:40]}")
    return text


def template_messages(messages: list[ChatMessage | dict], chat_template: str | None = None) -> list[dict]:
    """OpenAI messages → the dicts chat templates expect: text parts joined by newlines (as vLLM joins them),
    tool-call arguments as objects, and the developer role (OpenAI's successor to system) as system unless
    `chat_template` names it (Qwen2.5's template drops a developer message, SmolLM2's renders an unknown turn)."""
    developer = "developer" if "developer" in (chat_template or "") else "system"
    out = []
    for i, m in enumerate(messages):
        m = ChatMessage.model_validate(m) if isinstance(m, dict) else m
        d = m.model_dump(exclude_none=True)
        if m.role == "developer":
            d["role"] = developer
        if isinstance(m.content, list):
            texts = [part_text(part, f"messages[{i}].content[{j}]") for j, part in enumerate(m.content)]
            if None in texts:
                raise ApiError(422, "only text content parts are supported", param="messages",
                               code="unsupported_content")
            d["content"] = "\n".join(texts)
        for call in d.get("tool_calls", []):
            try:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
            except json.JSONDecodeError:
                pass  # templates that want a string get the string
        out.append(d)
    return out


async def enforce_tool_choice(server, tool_choice, offered: list[dict] | None, prompt_ids: list[int],
                              trace: CallTrace) -> tuple[list[int], ResponseFormat | None]:
    """tool_choice "required" or a named function, enforced (tools.forced_call): the prompt with the call's opening
    at its end, and the constraint on the rest; else the prompt as it is and None. Not for a taught rollout's call:
    the teacher's answer is its own."""
    if trace.rollout_id in server.taught or not (schema := forced_call(tool_choice, offered, server.tool_format)):
        return prompt_ids, None
    fmt = ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(schema=schema))
    await check_schema(fmt.json_schema, "tools")  # a tool's parameters that decoding cannot enforce: 400
    opening = server.tokenizer.encode(forced_opening(server.tool_format), add_special_tokens=False)
    return prompt_ids + opening, fmt


async def create_chat_completion(server, body: ChatCompletionRequest, trace: CallTrace):
    if body.functions is not None or body.function_call is not None:  # ignored, the model would never see them
        raise ApiError(422, "functions and function_call are the deprecated form of tools and tool_choice: send "
                            "those", param="functions" if body.functions is not None else "function_call",
                       code="unsupported")
    await server.check_request(body, body.response_format and body.response_format.json_schema,
                               "response_format.json_schema.schema")
    offered = resolve_tool_choice(body.tool_choice, [t.model_dump(exclude_none=True) for t in body.tools or []])
    use_tools = bool(offered)  # tools rendered into the prompt, and tool calls parsed from the answer
    messages = template_messages(body.messages, server.tokenizer.chat_template)
    prompt_ids, forced = await enforce_tool_choice(server, body.tool_choice, offered,
                                                   server.encode_chat(messages, offered), trace)
    requested = body.max_completion_tokens or body.max_tokens
    _, deltas = server.generate("chat", body, trace, [prompt_ids], requested, requested is not None, n=body.n,
                                stop=body.stop_list, top_logprobs=body.top_logprobs or 0,
                                fmt=forced or body.response_format, conversation=(messages, offered))
    meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": server.model_name}
    if body.stream:
        return sse_response(_chunks(server, body, deltas, meta, prompt_ids, use_tools, bool(forced)))
    choices = await collect_all(deltas)
    out = []
    for c in choices:
        content, calls = parse_tool_calls(c.text, server.tool_format, c.span_id, bool(forced),
                                          body.parallel_tool_calls is not False) if use_tools else (c.text, [])
        message = {"role": "assistant", "content": content, "refusal": None, "annotations": []}
        if calls:
            message["tool_calls"] = calls
        out.append({
            "index": c.index, "message": message, "finish_reason": "tool_calls" if calls else c.finish_reason,
            "logprobs": {"content": server.token_logprobs(c.token_ids, c.logprobs, c.top_logprobs), "refusal": None}
            if body.logprobs else None,
            "token_ids": c.token_ids,  # extension: the exact ids the engine produced
        })
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return {**meta, "object": "chat.completion", "choices": out,
            "usage": usage(len(prompt_ids), completion_tokens),
            "system_fingerprint": server.fingerprint(choices[0].policy_version), "prompt_token_ids": prompt_ids}


async def _chunks(server, body: ChatCompletionRequest, deltas, meta: dict, prompt_ids: list[int], use_tools: bool,
                  forced: bool):
    chunk = {**meta, "object": "chat.completion.chunk",
             "system_fingerprint": server.fingerprint(server.engine.policy_version)}
    parsers: dict[int, ToolCallStreamParser] = {}
    called: set[int] = set()  # choices that produced tool calls: they finish with "tool_calls"
    completion_tokens = 0

    def emit(index: int, delta: dict[str, Any], finish=None, logprobs=None, token_ids=None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return {**chunk, "choices": [choice]}

    for i in range(body.n):
        yield emit(i, {"role": "assistant", "content": ""})
    d: ChoiceDelta
    async for d in deltas:
        completion_tokens += len(d.token_ids)
        content, calls = d.text, []
        if use_tools:
            parser = parsers.setdefault(d.index, ToolCallStreamParser(server.tool_format, d.span_id, forced,
                                                                      body.parallel_tool_calls is not False))
            parsed = parser.feed(d.text)
            content, calls = parsed.content, parsed.tool_calls
            if d.finish_reason:
                rest = parser.finish()
                content, calls = content + rest.content, calls + rest.tool_calls
            if calls:
                called.add(d.index)
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        logprobs = ({"content": server.token_logprobs(d.token_ids, d.logprobs, d.top_logprobs), "refusal": None}
                    if body.logprobs else None)
        finish = ("tool_calls" if d.index in called else d.finish_reason) if d.finish_reason else None
        yield emit(d.index, delta, finish, logprobs, d.token_ids)
    if body.stream_options and body.stream_options.include_usage:
        yield {**chunk, "choices": [], "usage": usage(len(prompt_ids), completion_tokens),
               "prompt_token_ids": prompt_ids}
