"""OpenAI request schemas for /v1/chat/completions and /v1/completions, field for field.

Unknown fields are ignored (frameworks send metadata, user, store, ...). Fields we accept but cannot honour get a
clear 422 from the endpoint rather than being silently dropped. A JSON schema in a response format is checked by
the endpoint (check_schema: valid, and wholly enforceable by constrained decoding), so a bad one is a 400 naming it
before anything runs.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lightning_ray.serving.engines.grammar import check_json_schema
from lightning_ray.serving.http import ApiError


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class FunctionDef(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDef


class ToolCallFunction(_Request):
    name: str
    arguments: str


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Request):
    model_config = ConfigDict(extra="allow")  # name and other per-message fields pass through to the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        if self.content is None and not self.tool_calls:
            raise ValueError(f"a {self.role} message needs content")
        return self


class JsonSchemaFormat(_Request):
    """OpenAI's json_schema response format. The schema is enforced by constrained decoding whatever `strict` says
    (and strictly: an object that lists its properties gets no others); no schema: any JSON object."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # `schema` would shadow BaseModel.schema
    strict: bool | None = None


async def check_schema(spec: JsonSchemaFormat | None, param: str) -> None:
    """400 naming `param` unless the format's schema (if any) can be enforced. Run in a thread, not in request
    parsing: compiling a new schema can take long, and the replica's event loop serves every stream meanwhile."""
    if spec is not None and spec.schema_ is not None:
        try:
            await asyncio.to_thread(check_json_schema, spec.schema_)
        except ValueError as e:
            raise ApiError(400, f"{param}: {e}", param=param) from None


FormatType = Literal["text", "json_object", "json_schema"]


def json_constraint(kind: FormatType, spec: JsonSchemaFormat | None) -> dict[str, Any] | None:
    """The JSON schema a response format constrains the output to; None for free text."""
    if kind == "text":
        return None
    return spec.schema_ if kind == "json_schema" and spec and spec.schema_ is not None else {"type": "object"}


class ResponseFormat(_Request):
    """/v1/chat/completions' response_format."""

    type: FormatType
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs json_schema: {name, schema, strict}")
        return self

    @property
    def constraint(self) -> dict[str, Any] | None:
        return json_constraint(self.type, self.json_schema)


class TextFormat(JsonSchemaFormat):
    """/v1/responses' text.format: the same fields as JsonSchemaFormat, flat beside the type."""

    type: FormatType

    @property
    def constraint(self) -> dict[str, Any] | None:
        return json_constraint(self.type, self)


# _Sampling's options served only at their neutral values (first: the one to name), a trained policy sampling as it
# is: PolicyServer.check_request refuses others
UNSERVED_SAMPLING = {"presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},), "top_k": (-1, 0),
                     "min_p": (0,), "repetition_penalty": (1,), "min_tokens": (0,), "bad_words": ([],),
                     "allowed_token_ids": ([],)}


class _Sampling(_Request):
    model: str = Field(min_length=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=16)
    seed: int | None = Field(None, ge=-2**63, lt=2**63)  # what the engines' generators take (int64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Served at their neutral values only (UNSERVED_SAMPLING): each would change the policy's distribution
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    top_k: int | None = None  # vLLM's extensions, as an agent's extra_body sends them
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens (benchmarks, tests)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop):
        if isinstance(stop, list) and len(stop) > 4:
            raise ValueError("at most 4 sequences")
        return stop

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    functions: list[Any] | None = None  # the deprecated tools and tool_choice: refused (create_chat_completion)
    function_call: Any = None

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    @model_validator(mode="after")
    def _check_json_ends(self):
        if self.ignore_eos and self.response_format and self.response_format.constraint is not None:
            raise ValueError("ignore_eos cannot be combined with a JSON response_format: the end-of-sequence token "
                             "is what ends the JSON")
        return self


class CompletionRequest(_Sampling):
    # A string, strings, token ids, or lists of token ids (token-in/token-out for RL clients).
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0: the prompt alone, with echo (scored, with logprobs)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check_prompt(self):
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 generates nothing; it is for echo (a prompt scored with logprobs)")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)
