"""Teachers: who answers a taught rollout's calls in place of the policy, in an imitation run (jobs/imitate.py, the
warm start before RL). A teacher gives the assistant message; the server renders it in the policy's own chat
template, and the policy scores those tokens (SamplingParams.forced_token_ids): the call is recorded as if the policy
had sampled the answer (its token ids, its logprobs), and marked as the teacher's (semconv.TEACHER), so it is
imitation data, never RL data (algorithm/lightningrl.py).

- `oracle`: the task's own (tasks/<name>.py `oracle(task, messages, tools)`), which answers from the gold data.
- `model`: another model, an HF directory loaded beside the policy in each replica (HF engine, its own template).
- `endpoint`: any OpenAI-compatible endpoint (a bigger model served elsewhere).
"""

from __future__ import annotations

import json
import os
from typing import Protocol

from lightning_ray.serving.chat import template_messages
from lightning_ray.serving.engines import SamplingParams, generate, make_engine
from lightning_ray.serving.tools import parse_tool_calls, tool_call_format

TAUGHT = "teacher"  # a task's sampling key: its rollouts' calls are the teacher's to answer (trainer/collect.py)


class Teacher(Protocol):
    name: str  # recorded on each call it answered

    async def answer(self, task: dict, messages: list[dict], tools: list[dict] | None) -> dict:
        """The assistant message ({"content", "tool_calls"}) for the conversation so far; `task`: the rollout's task
        (Task.reward_input: its input and its reference)."""


class Oracle:
    def __init__(self, task: str):
        from lightning_ray.tasks import load_task

        self.name, self.oracle = f"oracle:{task}", load_task(task).oracle

    async def answer(self, task: dict, messages: list[dict], tools: list[dict] | None) -> dict:
        return self.oracle(task, messages, tools)


class ModelTeacher:
    def __init__(self, path: str, temperature: float, max_tokens: int, max_model_len: int):
        self.name, self.max_model_len = f"model:{path}", max_model_len
        # beside the policy's engine in its replica: the replica's random stream and GPU share stay the policy's
        self.engine = make_engine("hf", path, seed=None, gpu_memory_utilization=None)
        self.params = SamplingParams(temperature=temperature, max_tokens=max_tokens)

    async def answer(self, task: dict, messages: list[dict], tools: list[dict] | None) -> dict:
        tokenizer = self.engine.tokenizer
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                             add_generation_prompt=True), add_special_tokens=False)
        room = self.max_model_len - len(ids)
        if room <= 0:
            raise ValueError(f"the conversation ({len(ids)} tokens) leaves the teacher no room "
                             f"(max_model_len {self.max_model_len})")
        out = await generate(self.engine, ids, self.params.model_copy(
            update={"max_tokens": min(self.params.max_tokens, room)}))
        text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
        content, calls = parse_tool_calls(text, tool_call_format(tokenizer.chat_template)) if tools else (text, [])
        return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}


class EndpointTeacher:
    def __init__(self, base_url: str, model: str, api_key_env: str | None, temperature: float, max_tokens: int):
        from openai import AsyncOpenAI

        self.name, self.model, self.temperature, self.max_tokens = f"endpoint:{model}", model, temperature, max_tokens
        self.client = AsyncOpenAI(base_url=base_url, api_key=os.environ.get(api_key_env or "", "") or "EMPTY")

    async def answer(self, task: dict, messages: list[dict], tools: list[dict] | None) -> dict:
        def openai_form(m: dict) -> dict:  # tool-call arguments back to JSON text, as the API takes them
            calls = [{**c, "function": {**c["function"], "arguments": c["function"]["arguments"]
                                        if isinstance(c["function"]["arguments"], str)
                                        else json.dumps(c["function"]["arguments"])}} for c in m.get("tool_calls", [])]
            return {**m, "tool_calls": calls} if calls else m

        out = await self.client.chat.completions.create(
            model=self.model, messages=[openai_form(m) for m in messages], temperature=self.temperature,
            max_tokens=self.max_tokens, **({"tools": tools} if tools else {}))
        return out.choices[0].message.model_dump(include={"role", "content", "tool_calls"}, exclude_none=True)


def make_teacher(kind: str, task: str, path: str | None = None, base_url: str | None = None,
                 model: str | None = None, api_key_env: str | None = None, temperature: float = 0.0,
                 max_tokens: int = 256, max_model_len: int = 1024) -> Teacher:
    """A teacher from the run's `teacher.*` settings (config.TeacherConfig, checked there)."""
    if kind == "oracle":
        return Oracle(task)
    if kind == "model":
        return ModelTeacher(path, temperature, max_tokens, max_model_len)
    if kind == "endpoint":
        return EndpointTeacher(base_url, model, api_key_env, temperature, max_tokens)
    raise ValueError(f"unknown teacher {kind!r}: expected oracle, model or endpoint")


def answer_tokens(tokenizer, messages: list[dict], tools: list[dict] | None, answer: dict) -> list[int]:
    """The teacher's answer as the policy's tokens: the conversation with the answer appended, rendered by the
    policy's chat template, less the prompt the policy was given (its generation prompt included)."""
    answer = template_messages([{"role": "assistant", **answer}])[0]
    prompt = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    whole = tokenizer.apply_chat_template([*messages, answer], tools=tools, tokenize=False)
    if not whole.startswith(prompt) or len(whole) == len(prompt):
        raise ValueError("the chat template does not render the teacher's answer after the conversation's generation "
                         "prompt: its tokens cannot be the policy's")
    return tokenizer.encode(whole[len(prompt):], add_special_tokens=False)
