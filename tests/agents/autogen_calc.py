"""An AutoGen agent, written as AutoGen users write it, run from AutoGen's own venv against a base URL.

    python autogen_calc.py BASE_URL MODEL QUESTION    → prints the run's messages as JSON
"""

import asyncio
import json
import sys

from autogen_agentchat.agents import AssistantAgent
from autogen_ext.models.openai import OpenAIChatCompletionClient


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with + - * and parentheses."""
    if not set(expression) <= set("0123456789+-*() "):
        return "error: unsupported expression"
    return str(eval(expression))  # the characters are checked above


async def main(base_url: str, model: str, question: str) -> None:
    client = OpenAIChatCompletionClient(
        model=model, base_url=base_url, api_key="EMPTY",
        # AutoGen needs model_info for a model name it does not know
        model_info={"vision": False, "function_calling": True, "json_output": False, "family": "unknown",
                    "structured_output": False})
    agent = AssistantAgent("calc", model_client=client, tools=[calculator], reflect_on_tool_use=True,
                           system_message="Solve the arithmetic with the calculator tool. Then reply: ANSWER <number>.")
    result = await agent.run(task=question)
    print(json.dumps([{"type": m.type, "content": str(m.content)} for m in result.messages]))
    await client.close()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
