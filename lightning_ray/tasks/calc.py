"""The calculator task: reasoning-gym problems (basic_arithmetic, gsm_symbolic) solved with one calculator call.

The agent below is ordinary `openai`-client code. It gets a base URL and a model name and knows nothing of
training: any agent written this way can be trained unchanged. It speaks one of two protocols: "tools" (the
calculator offered through OpenAI function calling) or "text" (CALC <expression> lines answered with RESULT lines).
Rewards: an exact match of the answer's number (basic_arithmetic), or the generator's own scorer (gsm_symbolic).
"""

from __future__ import annotations

import ast
import json
import operator
import re
from fractions import Fraction
from functools import cache

import reasoning_gym
from openai import DefaultHttpxClient, OpenAI

from lightning_ray.tracing import emit_tool
from lightning_ray.types import Task

# Options given to make_tasks are laid over these, so `{max_digits: 1}` changes one thing, not all of them.
DEFAULT_OPTIONS: dict[str, dict] = {
    "basic_arithmetic": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2},
    "gsm_symbolic": {},
}
# Short and literal: a 135M instruct model has to follow them. The arithmetic prompts name the whole expression
# because a small model otherwise splits it into steps it then loses track of.
SYSTEM_PROMPT = ("You have a calculator. Write CALC <expression> with the whole expression to get RESULT <number>. "
                 "Then reply ANSWER <number>, copying the result exactly, including a minus sign.")
TOOL_SYSTEM_PROMPT = ("Call the calculator tool once with the whole expression. Then reply ANSWER <number>, copying "
                      "the result exactly, including a minus sign.")
GSM_SYSTEM_PROMPT = ("You have a calculator. Write the arithmetic expression that solves the problem as "
                     "CALC <expression> to get RESULT <number>. Then reply ANSWER <number>, copying the result exactly.")
GSM_TOOL_SYSTEM_PROMPT = ("Write the arithmetic expression that solves the problem and call the calculator tool once "
                          "with it. Then reply ANSWER <number>, copying the result exactly.")
PROMPTS = {("basic_arithmetic", "text"): SYSTEM_PROMPT, ("basic_arithmetic", "tools"): TOOL_SYSTEM_PROMPT,
           ("gsm_symbolic", "text"): GSM_SYSTEM_PROMPT, ("gsm_symbolic", "tools"): GSM_TOOL_SYSTEM_PROMPT}
CALCULATOR_TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
MAX_TURNS = 3  # model calls per episode: calculator, answer, and one retry
MAX_EXPRESSION = 200  # characters: bounds the work (and the size of the numbers) one calculator call can cause

_NUMBER = r"-?\d+(?:\.\d+)?"
_DECIMAL = re.compile(r"[-+]?\d+(?:\.\d+)?")
_CALC = re.compile(r"CALC:?\s*([-+*/(). \d]+)")
_ANSWER = re.compile(rf"ANSWER:?\s*({_NUMBER})")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def make_tasks(n: int, seed: int, dataset: str = "basic_arithmetic", options: dict | None = None,
               protocol: str = "tools", exclude: set[str] = frozenset()) -> list[Task]:
    """n problems with distinct questions, none of them in `exclude` (the held-out split's questions, so that
    training never sees them). Deterministic for the same arguments."""
    if dataset not in DEFAULT_OPTIONS:
        raise ValueError(f"dataset {dataset!r}: the calc task supports {', '.join(DEFAULT_OPTIONS)}")
    if protocol not in ("tools", "text"):
        raise ValueError(f"protocol {protocol!r}: expected 'tools' or 'text'")
    options = {**DEFAULT_OPTIONS[dataset], **(options or {})}
    # Small option ranges repeat questions, and exclude drops some: draw more until n are left. Each round starts
    # over from item 0, so the result depends on the arguments only, not on how a generator's items depend on size.
    size = n + len(exclude)
    while True:
        try:
            data = reasoning_gym.create_dataset(dataset, size=size, seed=seed, **options)
        except TypeError as e:  # an option its generator has not
            raise ValueError(f"the calc task's {dataset}: {e}") from None
        tasks, seen = [], set(exclude)
        for i in range(size):
            entry = data[i]
            # a problem once, however it is worded ("What is 3 + 4?", "Solve 3 + 4."); and only where the
            # calculator agrees with the answer (basic_arithmetic's generator divides with floor division)
            if {entry["question"], problem := _problem(entry)} & seen or not _calculator_agrees(dataset, entry):
                continue
            seen |= {entry["question"], problem}
            tasks.append(Task(task_id=f"{dataset}-{seed}-{len(tasks)}",
                              input={"question": entry["question"], "dataset": dataset, "protocol": protocol},
                              # the scorer's; the metadata holds the expression, which gives the answer away too
                              # (as JSON: tuples as lists, gsm_symbolic's fractions as text)
                              reference={"answer": entry["answer"], "problem": problem,
                                         "metadata": json.loads(json.dumps(entry["metadata"], default=str))}))
            if len(tasks) == n:
                return tasks
        if size >= 64 * (n + len(exclude)):
            raise ValueError(f"{dataset} with {options} gave only {len(tasks)} distinct questions outside `exclude` "
                             f"in {size} draws; {n} were asked for")
        size *= 2


def _problem(entry: dict) -> str:
    """What makes two items one problem, whatever their wording: the expression where the generator gives one."""
    expression = entry["metadata"].get("expression")
    return f"= {expression.replace(' ', '')}" if isinstance(expression, str) else entry["question"]


def _calculator_agrees(dataset: str, entry: dict) -> bool:
    """basic_arithmetic: whether the calculator's value of the expression is the answer. Its generator divides with
    floor division ("8 / -(5 * -8 + -39)" is 0 there, 0.101266 here): an agent using the tool right would score 0."""
    if dataset != "basic_arithmetic":
        return True
    try:
        return str(calculate(entry["metadata"]["expression"])) == entry["answer"]
    except (ValueError, SyntaxError, OverflowError):
        return False


def calculate(expression: str) -> int | float:
    """A safe calculator: numbers, + - * /, unary minus and parentheses; nothing else is evaluated. Exact (fractions)
    throughout, so a division that comes out whole gives an int, as the generators' answers are."""

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, not complex
            return Fraction(repr(node.value))  # 0.1 as written, not its binary approximation
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression: {expression!r}")

    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        value = ev(ast.parse(expression.strip(), mode="eval").body)
        return int(value) if value.denominator == 1 else round(float(value), 6)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:  # a result past a float's range ("1e200 * 1e200 / 3")
        raise ValueError("the result is too large") from None


def system_prompt(task: dict) -> str:
    """The task's own prompt for its dataset and protocol, unless the run gave one (task.system_prompt)."""
    return task.get("system_prompt") or PROMPTS[task["dataset"], task["protocol"]]


# One worked example, as earlier turns of the chat: a 135M model ignores instructions in a system prompt but
# continues a conversation's pattern (SmolLM2, greedy, 60 training problems: 13% → 52% with the text protocol).
EXAMPLES = {"basic_arithmetic": ("Calculate 7 - 12.", "7 - 12", -5),
            "gsm_symbolic": ("A box holds 12 pens. Tom buys 3 boxes and gives away 5 pens. How many pens does he "
                             "have left? Give the result as your final answer. Do not include units.", "12 * 3 - 5",
                             31)}


def opening(task: dict) -> list[dict]:
    """The system prompt and the worked example that every episode starts with."""
    question, expression, result = EXAMPLES[task["dataset"]]
    if task["protocol"] == "tools":
        call = {"id": "call_example", "type": "function",
                "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}
        solved = [{"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": call["id"], "content": str(result)}]
    else:
        solved = [{"role": "assistant", "content": f"CALC {expression}"},
                  {"role": "user", "content": f"RESULT {result}"}]
    return [{"role": "system", "content": system_prompt(task)}, {"role": "user", "content": question}, *solved,
            {"role": "assistant", "content": f"ANSWER {result}"}]


@cache
def _http_client() -> DefaultHttpxClient:
    """One HTTP client for every agent in the process, as the openai SDK advises: a client of its own per rollout
    loads the system's CA certificates each time (~30-50 ms of CPU, measured: a third of a 2-core machine's CPU in
    a training run's rollout phase, for plain-http calls) and opens a new connection for every rollout."""
    return DefaultHttpxClient()


def agent(task: dict, base_url: str, model: str, api_key: str = "EMPTY", http_client=None) -> str | None:
    """Ask the model, run its calculator calls, and return its final answer (None if it never gives one).
    `http_client`: an httpx client of the caller's (one OpenTelemetry instruments, to send the trace context)."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=http_client or _http_client())
    tools = {"tools": [CALCULATOR_TOOL]} if task["protocol"] == "tools" else {}
    messages = [*opening(task), {"role": "user", "content": task["question"]}]
    for _ in range(MAX_TURNS):
        message = client.chat.completions.create(model=model, messages=messages, **tools).choices[0].message
        text = message.content or ""
        if message.tool_calls:  # only offered in the tools protocol; an answer written beside a call is premature
            messages.append({"role": "assistant", "content": message.content, "tool_calls": [
                {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                              "arguments": c.function.arguments}}
                for c in message.tool_calls]})
            messages += [{"role": "tool", "tool_call_id": c.id, "content": _traced(
                c.function.name, c.function.arguments, _run_tool(c.function.name, c.function.arguments), c.id)}
                for c in message.tool_calls]
            continue
        messages.append({"role": "assistant", "content": text})
        if answer := _ANSWER.search(text):
            return _canonical(answer.group(1))
        if not tools and (call := _CALC.search(text)):
            result = _traced("calculator", call.group(1), _evaluate(call.group(1)))
            messages.append({"role": "user", "content": f"RESULT {result}"})
            continue
        # A final reply without the ANSWER marker: take its last number. The score is about the number, not the
        # marker, and the last number of a reply is its conclusion ("5 - 3 = 2", "the answer is 2"); the first
        # would often be an operand restated from the question. The rule is the same for every policy, and a
        # number still has to equal the answer exactly to score, so it rewards no more guessing than ANSWER does.
        numbers = re.findall(_NUMBER, text)
        return _canonical(numbers[-1]) if numbers else None
    return None


def _canonical(number: str) -> str:
    """A whole number as the generators write it ("2.0", "-0" -> "2", "0"), as the reward compares it with the
    reference's text."""
    value = Fraction(number)
    return str(int(value)) if value.denominator == 1 else number


def _evaluate(expression: str) -> str:
    try:
        return str(calculate(expression))
    except (ValueError, SyntaxError) as e:
        return f"error: {e}"


def _traced(name: str, arguments: str, result: str, call_id: str | None = None) -> str:
    """The one line of tracing this agent has: each calculator call as a tool span, whose status AIR can reward
    (a no-op outside a traced rollout); the tool call's id, where it has one, names the call that asked for it."""
    emit_tool(name, arguments, result, error=result.removeprefix("error: ") if result.startswith("error: ") else None,
              call_id=call_id)
    return result


def _run_tool(name: str, arguments: str) -> str:
    if name != "calculator":
        return f"error: no tool named {name!r}"
    try:
        args = json.loads(arguments)
    except ValueError:
        return "error: the arguments are not JSON"
    if not isinstance(args, dict) or not isinstance(args.get("expression"), str):
        return 'error: expected {"expression": "<arithmetic>"}'
    return _evaluate(args["expression"])


@cache
def _scorer(dataset: str):
    return reasoning_gym.get_score_answer_fn(dataset)  # builds a dataset object: once per dataset


def reward(task: dict, answer: str | None) -> float:
    """basic_arithmetic: 1 when the answer is the reference's number, however written ("7.0", " 7", 7), else 0. Not
    its generator's scorer, which gave partial credit to an answer containing the reference ("-2" and "12" scored
    0.5 for "2": always writing a minus sign paid) and less than 1 to "7.0". gsm_symbolic: its generator's scorer
    (the number it reads from the answer)."""
    if answer is None:
        return 0.0
    if task["dataset"] == "basic_arithmetic":  # a number as written, not "1e999999999" (a huge int to compute)
        number = str(answer).strip()
        return float(_DECIMAL.fullmatch(number) is not None and _canonical(number) == task["answer"])
    entry = {"question": task["question"], "answer": task["answer"], "metadata": task["metadata"]}
    return float(_scorer(task["dataset"])(str(answer), entry))


def oracle(task: dict, messages: list[dict], tools: list[dict] | None) -> dict:
    """The imitation teacher's answer (serving/teacher.py, teacher.kind=oracle) from the reference: the calculator
    call with the generator's expression (where its metadata has one), then the answer line."""
    last, expression = messages[-1], task["metadata"].get("expression")
    if expression is None or last["role"] == "tool" or str(last.get("content", "")).startswith("RESULT"):
        return {"content": f"ANSWER {task['answer']}"}
    if tools:
        return {"content": None, "tool_calls": [{"id": "call_oracle", "type": "function", "function": {
            "name": "calculator", "arguments": json.dumps({"expression": expression})}}]}
    return {"content": f"CALC {expression}"}


def demonstrations(tasks: list[Task]) -> list[list[dict]]:
    """Correct transcripts of the text protocol, used only to warm up the tiny test model (basic_arithmetic: the
    expression is the generator's)."""
    out = []
    for t in tasks:
        expr = t.reference["metadata"]["expression"]
        out.append([
            *opening({**t.input, "protocol": "text"}),
            {"role": "user", "content": t.input["question"]},
            {"role": "assistant", "content": f"CALC {expr}"},
            {"role": "user", "content": f"RESULT {calculate(expr)}"},
            {"role": "assistant", "content": f"ANSWER {calculate(expr)}"},
        ])
    return out


def tool_demonstrations(tasks: list[Task]) -> list[list[dict]]:
    """Correct transcripts of the function-calling protocol (render them with tools=[CALCULATOR_TOOL])."""
    out = []
    for i, t in enumerate(tasks):
        expr = t.reference["metadata"]["expression"]
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": expr}}}
        out.append([
            *opening({**t.input, "protocol": "tools"}),
            {"role": "user", "content": t.input["question"]},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": str(calculate(expr))},
            {"role": "assistant", "content": f"ANSWER {calculate(expr)}"},
        ])
    return out
