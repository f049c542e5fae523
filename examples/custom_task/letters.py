"""A task of your own: how many letters a word has. It is what `task.name=examples.custom_task.letters` trains on,
and the shape any task of yours takes (docs/03-agents-and-tasks.md, Your own task): make_tasks gives the problems,
reward scores an answer, agent is the default agent (optional: task.agent or task.command may bring one instead)."""

from __future__ import annotations

import random
import re

from openai import OpenAI

from lightning_ray.types import Task

WORDS = ("apple banana cherry grape lemon mango melon orange peach pear plum kiwi fig lime date papaya guava quince "
         "apricot olive tomato potato carrot onion garlic pepper ginger radish turnip celery spinach lettuce cabbage "
         "squash pumpkin walnut almond cashew peanut hazelnut chestnut coconut raisin prune currant berry").split()
PROMPT = "Count the letters of the word you are given. End your answer with a line: ANSWER <number>."


def make_tasks(n: int, seed: int, dataset: str = "words", options: dict | None = None, protocol: str = "text",
               exclude: set[str] = frozenset()) -> list[Task]:
    """n problems, deterministic for the arguments, none whose question is in `exclude` (the held-out split's).
    A ValueError for a setting this task has not: the job reports it as a config error, before anything starts."""
    if dataset != "words" or options or protocol != "text":
        raise ValueError("the letters task has one dataset (words), no generator options and the text protocol")
    pool = [w for w in WORDS if f"How many letters are in {w!r}?" not in exclude]
    if n > len(pool):
        raise ValueError(f"the letters task has {len(pool)} problems here, not {n} (task.train_size, eval_size)")
    words = random.Random(seed).sample(pool, n)
    return [Task(task_id=f"letters-{seed}-{i}", input={"question": f"How many letters are in {w!r}?"},
                 reference={"answer": len(w)}) for i, w in enumerate(words)]


def reward(task: dict, answer: str | None) -> float:
    """task: the problem's input and reference together; answer: what the agent returned."""
    return float(answer is not None and answer.strip() == str(task["answer"]))


def agent(task: dict, base_url: str, model: str, api_key: str = "EMPTY") -> str | None:
    """One call to the policy, through the base URL the rollout worker gives (the calls it records are the
    training data); the number on the ANSWER line."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = client.chat.completions.create(model=model, messages=[
        {"role": "system", "content": PROMPT}, {"role": "user", "content": task["question"]}]).choices[0].message
    found = re.findall(r"ANSWER\s*(-?\d+)", reply.content or "")
    return found[-1] if found else None
