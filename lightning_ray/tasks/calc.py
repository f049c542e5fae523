"""The calculator task: small-number arithmetic with one calculator call.

The agent below is ordinary `openai`-client code. It gets a base URL and a model name and knows nothing of
training: any agent written this way can be trained unchanged.
"""

from __future__ import annotations

import ast
import operator
import random
import re

from openai import OpenAI

from lightning_ray.types import Task

SYSTEM_PROMPT = "Solve the arithmetic. Use the calculator: CALC <expression>. Then reply: ANSWER <number>."
# The same task for agents that call functions (OpenAI tools) instead of writing CALC lines.
TOOL_SYSTEM_PROMPT = "Solve the arithmetic with the calculator tool. Then reply: ANSWER <number>."
CALCULATOR_TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression of integers with + - * and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
MAX_TURNS = 3

_CALC = re.compile(r"CALC\s+([-+*/() \d]+)")
_ANSWER = re.compile(r"ANSWER\s+(-?\d+)")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg}


def make_tasks(n: int, seed: int) -> list[Task]:
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        a, b, op = rng.randint(0, 20), rng.randint(0, 20), rng.choice("+-")
        tasks.append(Task(task_id=f"calc-{seed}-{i}", input={"question": f"What is {a} {op} {b}?", "answer": calculate(f"{a}{op}{b}")}))
    return tasks


def calculate(expression: str) -> int:
    """A safe integer calculator: + - * and parentheses, nothing else is evaluated."""

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression: {expression!r}")

    return ev(ast.parse(expression.strip(), mode="eval").body)


def agent(task: dict, base_url: str, model: str, api_key: str = "EMPTY") -> str | None:
    """Ask the model, run its calculator calls, and return its final answer (None if it never gives one)."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task["question"]}]
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model=model, messages=messages).choices[0].message.content or ""
        messages.append({"role": "assistant", "content": reply})
        if answer := _ANSWER.search(reply):
            return answer.group(1)
        if call := _CALC.search(reply):
            try:
                result = str(calculate(call.group(1)))
            except (ValueError, SyntaxError, ZeroDivisionError) as e:
                result = f"error: {e}"
            messages.append({"role": "user", "content": f"RESULT {result}"})
        else:
            return None
    return None


def reward(task: dict, answer: str | None) -> float:
    return float(answer is not None and int(answer) == task["answer"])


def _expression(task: Task) -> str:
    return task.input["question"].removeprefix("What is ").removesuffix("?").replace(" ", "")


def demonstrations(tasks: list[Task]) -> list[list[dict]]:
    """Correct transcripts of the agent's protocol, used only to warm up the tiny test model."""
    out = []
    for t in tasks:
        expr = _expression(t)
        out.append([
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": t.input["question"]},
            {"role": "assistant", "content": f"CALC {expr}"},
            {"role": "user", "content": f"RESULT {t.input['answer']}"},
            {"role": "assistant", "content": f"ANSWER {t.input['answer']}"},
        ])
    return out


def tool_demonstrations(tasks: list[Task]) -> list[list[dict]]:
    """Correct transcripts of the function-calling protocol (render them with tools=[CALCULATOR_TOOL])."""
    out = []
    for i, t in enumerate(tasks):
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": _expression(t)}}}
        out.append([
            {"role": "system", "content": TOOL_SYSTEM_PROMPT},
            {"role": "user", "content": t.input["question"]},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": str(t.input["answer"])},
            {"role": "assistant", "content": f"ANSWER {t.input['answer']}"},
        ])
    return out
