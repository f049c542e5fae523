"""What the tests build once per machine into the user cache (keyed on their inputs), and the process that builds
them in the background from the start of a session (conftest.py): on a fresh machine the tiny model first, at normal
priority (most integration tests wait for it), then the others at the lowest (`nice` 19), on the cores the running
tests leave idle, so a test that needs one finds it built, or waits on its lock (models._cached) for the rest.

    python tests/builds.py rag    # the tiny model, then the rag model"""

from __future__ import annotations

import inspect
import os
import random
import sys
from functools import partial
from pathlib import Path

import torch

from lightning_ray.config import ModelConfig
from lightning_ray.models import _cached, content_key, resolve_model_path
from lightning_ray.serving.chat import template_messages
from lightning_ray.serving.responses import ResponsesRequest, to_chat
from lightning_ray.tasks import rag

WORLD = {"people": 60}  # 120 questions over 131 facts: quick to embed in every rollout worker


def warm_up_on_rag(base: Path, out: Path, steps: int = 200, seed: int = 0) -> Path:
    """The tiny model trained further on correct episodes of the agent (rag.demonstrations), rendered exactly as
    the server renders the SDK's requests (to_chat, then the chat template with the SDK's own tool schema); the
    loss on what follows the prompt, i.e. the searches, their results and the answer."""
    from agents.models.openai_responses import Converter
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tasks = rag.make_tasks(2 * WORLD["people"], seed=seed, options=WORLD)
    tools = Converter.convert_tools([rag.search_tool(rag.index(tasks[0].input))], handoffs=[]).tools
    episodes = []
    for task, items in zip(tasks, rag.demonstrations(tasks)):
        messages, chat_tools, _ = to_chat(ResponsesRequest(model="m", input=items, instructions=rag.INSTRUCTIONS,
                                                           tools=tools))
        messages = template_messages(messages)
        asked = len(messages) - 2 * len(task.reference["decomposition"]) - 1  # the agent's turns after the question
        prompt = tokenizer.apply_chat_template(messages[:asked], tools=chat_tools, add_generation_prompt=True)
        whole = tokenizer.apply_chat_template(messages, tools=chat_tools)
        episodes.append((whole["input_ids"], len(prompt["input_ids"])))
    rng, optimizer = random.Random(seed), torch.optim.AdamW(model.parameters(), lr=5e-3)
    model.train()
    for _ in range(steps):
        batch = rng.sample(episodes, 8)
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids, _ in batch])
        mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch])
        labels = torch.tensor([[-100] * n + ids[n:] + [-100] * (width - len(ids)) for ids, n in batch])
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def rag_model(tiny: Path) -> Path:
    """The tiny model warmed up further on rag episodes: keyed on the base model's own key, the warm-up's code and the
    agent's prompts and demonstrations; 200 steps in ~70 s on both cores of this machine, alone."""
    key = content_key(tiny.name, inspect.getsource(warm_up_on_rag), Path(rag.__file__).read_text())
    return _cached(Path(ModelConfig().cache_dir).expanduser() / f"tiny-rag-{key}", partial(warm_up_on_rag, tiny))


if __name__ == "__main__":
    tiny = resolve_model_path(ModelConfig())
    os.nice(19)
    for name in sys.argv[1:]:
        {"rag": rag_model}[name](tiny)
