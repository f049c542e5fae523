"""Tool calls in model text: parse them out of a completion (whole or streamed) and check `tool_choice`.

Models write tool calls as text in a format their chat template taught them. Each format is one entry of
TOOL_CALL_FORMATS (an opening marker, an optional closing marker, and a parser for the text between them), so a
new model family needs a new entry, not a new parser.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable


@dataclass(frozen=True)
class ToolCallFormat:
    start: str  # the marker that opens a block of tool calls ("": none, the completion itself is the block)
    end: str | None  # the marker that closes it; None: the block runs to the end of the completion
    parse: Callable[[str], list[tuple[str, str]] | None]  # block body -> [(name, arguments JSON)], None if malformed
    arguments: str = "arguments"  # the key a call's arguments go under, as the template teaches (a forced call's)


def _parse_json_calls(body: str, named_arguments: bool = False) -> list[tuple[str, str]] | None:
    """One call object, or a list of them: {"name": ..., "arguments": {...} | "<json>"} ("parameters" also accepted).
    `named_arguments`: a call must have its arguments key, for a format without markers, where a JSON answer that
    merely has a "name" ({"name": "Alice", "age": 30}) is content (as vLLM's Llama 3 JSON parser reads it)."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    calls = []
    for obj in data if isinstance(data, list) else [data]:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        if named_arguments and "arguments" not in obj and "parameters" not in obj:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            calls.append((obj["name"], args))  # already a JSON string: keep the model's exact text
        elif isinstance(args, dict):
            calls.append((obj["name"], json.dumps(args, ensure_ascii=False)))
        else:
            return None
    return calls or None


TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {
    # Hermes, Qwen2.5, Qwen3 and the tiny test model: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
    "hermes": ToolCallFormat("<tool_call>", "</tool_call>", _parse_json_calls),
    # Mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] up to the end (needs special tokens decoded)
    "mistral": ToolCallFormat("[TOOL_CALLS]", None, _parse_json_calls),
    # Llama 3.1-3.3's JSON calls: the whole answer is {"name": ..., "parameters": {...}}, no marker (its
    # <|python_tag|> is a special token, decoded away): a completion that opens with "{" or "[" is a block
    "llama3_json": ToolCallFormat("", None, partial(_parse_json_calls, named_arguments=True), arguments="parameters"),
}


def tool_call_format(chat_template: str | None) -> str:
    """The format a chat template teaches its model (hermes where it names none we know)."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if '"parameters"' in template and ("<|python_tag|>" in template or "ipython" in template):
        return "llama3_json"
    return "hermes"


def tool_call_id(span_id: str, n: int) -> str:
    """The id of the n-th tool call of the answer the server records as span `span_id`. An agent's tool span that
    reports it (gen_ai.tool.call.id) names the call that asked for the tool by it, not by a clock (algorithm/air.py).
    Without a span id (a completion parsed outside a call): a random one, as OpenAI's."""
    return f"call_{span_id}_{n}" if span_id else f"call_{uuid.uuid4().hex[:24]}"


def asking_span_id(call_id: str) -> str | None:
    """The span id of the answer that made tool call `call_id` (tool_call_id's inverse), or None for ids made
    elsewhere."""
    return m.group(1) if (m := _OUR_CALL_ID.fullmatch(call_id)) else None


_OUR_CALL_ID = re.compile(r"call_([0-9a-f]{16})_\d+")


@dataclass
class ToolStreamDelta:
    content: str = ""  # text to send as a content delta now ("" for none)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI streaming tool_call deltas, complete


class ToolCallStreamParser:
    """Splits a completion, fed as text deltas, into content and tool calls as early as is safe.

    - Content is passed on at once, except text that may be the beginning of an opening marker (a trailing
      "<tool" is held until the next delta shows whether "<tool_call>" follows) and trailing whitespace (held
      until it is known whether a tool call follows it).
    - From an opening marker on, text is held until the closing marker (for formats without one, until finish()).
      A format with no opening marker (Llama 3's JSON) holds an answer that opens with "{" or "[" to its end.
      A well-formed block then yields its calls as complete OpenAI streaming deltas: {"index", "id", "type":
      "function", "function": {"name", "arguments"}}, index counting the calls of the completion. A malformed or
      unclosed block is passed on as content, unchanged.
    - Whitespace around blocks is tidied: a whitespace run right before a block is dropped; after a block it is
      kept only between two pieces of content ("Hi <block> there" gives "Hi there"); after the last block it is
      dropped. A completion without tool calls comes out byte for byte.
    - `parallel` False (the request's parallel_tool_calls: false): the first call alone; the calls after it are
      dropped, not passed on as content (as vLLM keeps only the first).
    - finish() flushes what is held. Concatenating the content of all deltas gives what parse_tool_calls returns.
    """

    def __init__(self, fmt: str = "hermes", span_id: str = "", forced: bool = False, parallel: bool = True):
        if fmt not in TOOL_CALL_FORMATS:
            raise ValueError(f"unknown tool call format {fmt!r}: expected one of {sorted(TOOL_CALL_FORMATS)}")
        self.fmt = TOOL_CALL_FORMATS[fmt]
        self._buf = ""  # text received but not yet classified
        # The open block's markers as the text has them. `forced` (forced_call): the server wrote the opening at
        # the prompt's end and the answer is the block's body, so a body that does not parse is passed on as it is.
        self._in_block = forced
        self._opening, self._closing = ("", None) if forced else (self.fmt.start, self.fmt.end)
        self._ws_held = ""  # trailing whitespace of the content so far, not yet sent
        self._ws_before_block = ""  # what _ws_held was when the current block opened (sent if the block is bad)
        self._sent_content = False
        self._n_calls = 0
        self._parallel = parallel
        self._span_id = span_id  # the answer's span: its calls' ids name it (tool_call_id)
        self._out = ToolStreamDelta()

    def feed(self, delta: str) -> ToolStreamDelta:
        self._buf += delta
        return self._drain(final=False)

    def finish(self) -> ToolStreamDelta:
        out = self._drain(final=True)
        if not self._n_calls:  # whitespace is only tidied around tool calls
            out.content += self._ws_held
        self._ws_held = ""
        return out

    def _drain(self, final: bool) -> ToolStreamDelta:
        start, end = self.fmt.start, self.fmt.end
        while self._buf or (final and self._in_block):  # a block may be open with nothing after its marker
            if not self._in_block and not start:  # no marker: a block only where the completion opens with JSON
                rest = self._buf.lstrip()
                if self._sent_content or self._n_calls or not rest.startswith(("{", "[")):
                    if rest or final:  # (only whitespace so far: held)
                        self._emit_text(self._buf)
                        self._buf = ""
                    break
                self._ws_held += self._buf[:len(self._buf) - len(rest)]
                self._buf, self._in_block, self._ws_before_block, self._ws_held = rest, True, self._ws_held, ""
            elif not self._in_block:
                i = self._buf.find(start)
                if i < 0:
                    keep = 0 if final else _partial_suffix(self._buf, start)
                    self._emit_text(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                self._emit_text(self._buf[:i])
                self._buf = self._buf[i + len(start):]
                self._in_block, self._ws_before_block, self._ws_held = True, self._ws_held, ""
            else:
                opening, closing = self._opening, self._closing
                j = self._buf.find(closing) if closing else (len(self._buf) if final else -1)
                if j < 0:
                    if final:  # unclosed block (e.g. cut by max_tokens): it was text after all
                        self._emit_text(self._ws_before_block + opening + self._buf)
                        self._buf, self._in_block = "", False
                    break
                body, self._buf = self._buf[:j], self._buf[j + len(closing or ""):]
                self._in_block, self._opening, self._closing = False, start, end
                calls = self.fmt.parse(body.strip())
                if calls is None:
                    self._emit_text(self._ws_before_block + opening + body + (closing or ""))
                for name, arguments in calls or []:
                    if self._parallel or not self._n_calls:
                        self._out.tool_calls.append({"index": self._n_calls,
                                                     "id": tool_call_id(self._span_id, self._n_calls),
                                                     "type": "function",
                                                     "function": {"name": name, "arguments": arguments}})
                    self._n_calls += 1
        out, self._out = self._out, ToolStreamDelta()
        return out

    def _emit_text(self, text: str) -> None:
        text = self._ws_held + text
        if self._n_calls and not self._sent_content:
            text = text.lstrip()  # no whitespace between a leading block and the first content
        body = text.rstrip()
        self._ws_held = text[len(body):]
        if body:
            self._out.content += body
            self._sent_content = True


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def parse_tool_calls(text: str, fmt: str = "hermes", span_id: str = "", forced: bool = False,
                     parallel: bool = True) -> tuple[str | None, list[dict[str, Any]]]:
    """Split a completion into its content (None if empty) and OpenAI tool calls {"id", "type", "function"}; `span_id`:
    the answer's span, which the calls' ids name (tool_call_id); `forced`: the answer of a forced_call; `parallel`
    False: the first call alone (parallel_tool_calls: false)."""
    parser = ToolCallStreamParser(fmt, span_id, forced, parallel)
    first, last = parser.feed(text), parser.finish()
    calls = [{k: v for k, v in c.items() if k != "index"} for c in first.tool_calls + last.tool_calls]
    return (first.content + last.content) or None, calls


def resolve_tool_choice(tool_choice: str | dict | None, tools: list[dict] | None) -> list[dict] | None:
    """Check a chat-completions `tool_choice` against `tools`; return the tools to offer the model (None: none).

    The result is what to render into the prompt and whether to parse calls out of the completion (parse iff not
    None). "none" offers no tools; a named function offers only that one ("required" and a named function are
    then enforced: forced_call). Raises ValueError (HTTP 400, its param the text before ": ") on bad input.
    """
    names = []
    for i, tool in enumerate(tools or []):
        if not _is_function_ref(tool):
            raise ValueError(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ...}}}}")
        names.append(tool["function"]["name"])
    if tool_choice is None:
        tool_choice = "auto"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ValueError(f"tool_choice: expected 'none', 'auto', 'required' or a function, got {tool_choice!r}")
        if tool_choice == "required" and not names:
            raise ValueError("tool_choice: 'required' needs at least one tool in tools")
        return list(tools) if tools and tool_choice != "none" else None
    if not _is_function_ref(tool_choice):
        raise ValueError("tool_choice: expected {'type': 'function', 'function': {'name': ...}}")
    name = tool_choice["function"]["name"]
    if name not in names:
        known = ", ".join(names) or "none given"
        raise ValueError(f"tool_choice: function {name!r} is not in tools ({known})")
    return [t for t in tools if t["function"]["name"] == name]


def forced_opening(fmt: str = "hermes") -> str:
    """What the server writes at the prompt's end for a forced call: the format's opening marker, as its template
    writes a call (Hermes and Qwen: "<tool_call>\n"; Llama's JSON: nothing)."""
    start = TOOL_CALL_FORMATS[fmt].start
    return start + "\n" if start else ""


def forced_call(tool_choice: str | dict | None, offered: list[dict] | None, fmt: str = "hermes") -> dict | None:
    """The JSON schema that enforces tool_choice "required" or a named function (None for "auto", "none"): one call
    {"name", "arguments"} of an offered tool (the format's word for arguments), its arguments per the tool's
    parameters. The server writes the call's opening (forced_opening) at the prompt's end, the model continues from
    it as from its own, decoding constrained to this schema, and the call ends the answer (the end-of-sequence token
    is all the grammar allows after it) — a call whatever the model's size, as OpenAI and vLLM guarantee it."""
    if not offered or tool_choice in (None, "auto", "none"):
        return None
    key = TOOL_CALL_FORMATS[fmt].arguments
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               key: t["function"].get("parameters") or {"type": "object"}},
              "required": ["name", key], "additionalProperties": False} for t in offered]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def _is_function_ref(obj: Any) -> bool:
    """Is obj shaped {"type": "function", "function": {"name": <str>, ...}}?"""
    fn = obj.get("function") if isinstance(obj, dict) else None
    return isinstance(fn, dict) and obj.get("type") == "function" and isinstance(fn.get("name"), str)
