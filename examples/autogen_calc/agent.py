"""The calculator task as an AutoGen AssistantAgent with a tool, written as AutoGen users write it against OpenAI.

AutoGen 0.7 pins protobuf 5 and an older openai than the trainer's, so its rollout workers get their own Ray
runtime_env (configs/task/calc_autogen.yaml: the pins of envs/autogen/constraints.txt):

    make train ARGS="task=calc_autogen"
"""

import asyncio
import re

from autogen_agentchat.agents import AssistantAgent
from autogen_ext.models.openai import OpenAIChatCompletionClient

from lightning_ray.tasks.calc import calculate

SYSTEM = "Call the calculator tool once with the whole expression. Then reply ANSWER <number>."
# AutoGen asks what a model it does not know can do
MODEL_INFO = {"vision": False, "function_calling": True, "json_output": False, "family": "unknown",
              "structured_output": False}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses."""
    try:
        return str(calculate(expression))
    except (ValueError, SyntaxError) as e:
        return f"error: {e}"


async def solve(question: str, base_url: str, model: str, api_key: str) -> str:
    client = OpenAIChatCompletionClient(model=model, base_url=base_url, api_key=api_key, model_info=MODEL_INFO,
                                        max_retries=0)
    try:
        assistant = AssistantAgent("calc", model_client=client, tools=[calculator], reflect_on_tool_use=True,
                                   system_message=SYSTEM)
        result = await assistant.run(task=question)
        return str(result.messages[-1].content)
    finally:
        await client.close()


def agent(task: dict, base_url: str, model: str, api_key: str) -> str | None:
    """The rollout worker's entry point (task.agent): the final answer's number, as the task's scorer wants it."""
    reply = asyncio.run(solve(task["question"], base_url, model, api_key))
    # the number after the last ANSWER; without one, the reply's last number, its conclusion ("7 - 12 = -5")
    _, marker, tail = reply.rpartition("ANSWER")
    numbers = re.findall(r"-?\d+(?:\.\d+)?", tail)
    return (numbers[0] if marker else numbers[-1]) if numbers else None
