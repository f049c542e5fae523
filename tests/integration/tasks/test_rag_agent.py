"""The rag task's Agents SDK agent trains through the whole stack: Ray, Serve with the HF engine, our /v1/responses
(the SDK's default API), the SQLite trace store, LightningRL and Ray Train + DeepSpeed, on a tiny model.

The shared tiny model was warmed up on calculator transcripts only: given this agent's prompt it answers at once
("ANSWER 63") and never searches (32 of 32 rollouts, measured). So this test warms it up further, once per machine,
on correct rag episodes (~1 min), until it calls `search` some of the time. Its answers stay poor: the checks
are of the plumbing, not of the rewards."""

from __future__ import annotations

import inspect
import json
import random
import sqlite3
from collections import Counter
from functools import partial
from pathlib import Path

import pytest
from helpers import small
import torch

from lightning_ray.config import ModelConfig
from lightning_ray.models import BUILD_PACKAGES, _cached, content_key
from lightning_ray.serving.chat import template_messages
from lightning_ray.serving.responses import ResponsesRequest, to_chat
from lightning_ray.serving.tools import asking_span_id
from lightning_ray.tasks import rag
from lightning_ray.trainer import train

WORLD = {"people": 60}  # 120 questions over 131 facts: quick to embed in every rollout worker


def warm_up_on_rag(base: Path, out: Path, steps: int = 200, seed: int = 0) -> Path:
    """The tiny model trained further on correct episodes of the agent (rag.demonstrations), rendered exactly as
    the server renders the SDK's requests (to_chat, then the chat template with the SDK's own tool schema); the
    loss on what follows the prompt, i.e. the searches, their results and the answer."""
    from agents.models.openai_responses import Converter
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightning_ray.models.tiny import next_token_loss

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
        answer = torch.tensor([[False] * n + [True] * (len(ids) - n) + [False] * (width - len(ids))
                               for ids, n in batch])
        next_token_loss(model, ids, answer[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def rag_model_path(tiny_model_path) -> Path:
    # keyed on the base model's own key, the warm-up's code, the agent's package (prompts, world, retrieval) and
    # what renders its demonstrations (the Responses API's conversion, the chat template's messages, the Agents SDK);
    # built on every core (nothing else runs meanwhile): 200 steps in ~62 s here, against 104 with an attention
    # mask and the LM head on every position
    sources = [*sorted(Path(rag.__file__).parent.glob("*.py")), Path(to_chat.__code__.co_filename),
               Path(template_messages.__code__.co_filename)]
    key = content_key(tiny_model_path.name, inspect.getsource(warm_up_on_rag), *(p.read_text() for p in sources),
                      packages=(*BUILD_PACKAGES, "openai-agents"))
    return _cached(Path(ModelConfig().cache_dir).expanduser() / f"tiny-rag-{key}",
                   partial(warm_up_on_rag, tiny_model_path))


@pytest.fixture(scope="module")
def run(ray_cluster, rag_model_path, serve_port, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("rag-run")
    task = {"name": "rag", "dataset": "facts", "protocol": "tools", "generator": WORLD, "train_size": 40,
            "eval_size": 4}
    cfg = small({
        "run_dir": str(run_dir),
        "model": {"path": str(rag_model_path)},
        "serve": {"port": serve_port},
        # the tools block, the worked example and three searches: ~1,300 of the tiny model's tokens (its BPE was
        # fitted to arithmetic); its rotary positions run past its 512 all the same
        "engine": {"max_model_len": 1536},
        # at 0.7 (make train's) ~35% of first calls are a whole search call, measured; at 1.0 (the bare config's)
        # ~12%, and most rollouts end at max_tokens mid-call (the SDK raises: failed): a run could see no search
        "rollout": {"tasks_per_iteration": 4, "group_size": 4, "agents_per_worker": 4, "temperature": 0.7},
        # one iteration: the plumbing is all in it; a second (measured) can find every group alike after the update
        "trainer": {"iterations": 1, "eval_every": 0},
        "learner": {"lr": 1e-3},
        # Final rewards are nearly all 0 from this model, so AIR gives the signal: +0.1 for each search the SDK
        # ran (the agent's tool span), -0.1 for a <tool_call> block nobody could parse, each credited to its call
        "task": {**task, "air": {"tool_ok": 0.1, "malformed_tool_call": -0.1}},
        # many groups score alike (iteration 0 of a run took 2 rounds for 4 groups with a signal): sample again (DAPO)
        "algorithm": {"credit": "per_step", "dynamic_sampling": True, "max_sampling_rounds": 3},
    })
    history = train(cfg)
    db = sqlite3.connect(run_dir / "traces-spans.sqlite")
    spans = [{"rollout_id": r[0], "name": r[1], "attributes": json.loads(r[2]), "span_id": r[3], "parent_id": r[4]}
             for r in db.execute("SELECT rollout_id, name, attributes, span_id, parent_id FROM spans "
                                 "WHERE rollout_id IS NOT NULL")]
    rows = sqlite3.connect(run_dir / "traces.sqlite").execute(
        "SELECT rollout_id, task, reward, status, error FROM rollouts")
    rollouts = [{"rollout_id": r[0], "task": json.loads(r[1]), "reward": r[2], "status": r[3], "error": r[4]}
                for r in rows]
    return {"history": history, "spans": spans, "rollouts": rollouts}


def test_every_responses_call_becomes_a_transition(run):
    assert len(run["history"]) == 1
    for h in run["history"]:
        # 4 groups of 4 rollouts, and a group more for each one dropped without a signal (up to 3 rounds)
        assert h["rollouts"] == 4 * (h["groups_with_signal"] + h["groups_dropped"]) >= 16
        assert h["infra_failed_rollouts"] == 0
        assert h["transitions"] == h["llm_spans"] >= h["rollouts"]  # at least one model call per rollout
        assert h["groups_with_signal"] > 0 and h["updated"]
    calls = [s["attributes"] for s in run["spans"] if s["name"] == "llm.call"]
    assert {c["gen_ai.operation.name"] for c in calls} == {"responses"}
    for c in calls:  # the SDK sent the agent's instructions and its one function tool with every call
        assert c["lightning_ray.request"]["instructions"] == rag.INSTRUCTIONS
        assert [t["name"] for t in c["lightning_ray.request"]["tools"]] == ["search"]


def test_the_model_searches_and_the_sdk_runs_the_tool(run):
    """A search the model asked for was run by the SDK (the agent's tool span, with the passages it returned), its
    output went back to the model as a function_call_output in the same rollout's next request, and AIR rewarded
    the call that asked for it."""
    searches = [s for s in run["spans"] if s["name"] == "execute_tool search"]
    assert searches, Counter((r["status"], r["error"]) for r in run["rollouts"])
    assert all(s["attributes"]["gen_ai.tool.call.result"].count("\n") == rag.TOP_K - 1 for s in searches)
    calls_per_rollout = Counter(s["rollout_id"] for s in run["spans"] if s["name"] == "llm.call")
    searched = {s["rollout_id"] for s in searches}
    assert all(calls_per_rollout[r] >= 2 for r in searched)  # the model was called again after each search
    followed = [s["attributes"]["lightning_ray.request"]["input"] for s in run["spans"]
                if s["name"] == "llm.call" and s["rollout_id"] in searched]
    outputs = [item["output"] for items in followed for item in items[len(rag.opening()) + 1:]
               if item.get("type") == "function_call_output"]
    assert {s["attributes"]["gen_ai.tool.call.result"] for s in searches} <= set(outputs)
    air = Counter(s["attributes"]["lightning_ray.air.rule"] for s in run["spans"]
                  if s["name"] == "reward" and "lightning_ray.air.rule" in s["attributes"])
    assert air["tool_ok"] == len(searches)
    # each search's reward went to the call whose tool call the SDK ran, named by the call's id, not by clocks
    asked = {s["span_id"]: asking_span_id(s["attributes"]["gen_ai.tool.call.id"]) for s in searches}
    credited = {s["parent_id"]: s["attributes"]["lightning_ray.reward.call"] for s in run["spans"]
                if s["name"] == "reward" and s["attributes"].get("lightning_ray.air.rule") == "tool_ok"}
    assert credited == asked and set(asked.values()) <= {s["span_id"] for s in run["spans"] if s["name"] == "llm.call"}


def test_the_reward_is_the_tasks_score_of_the_models_last_reply(run):
    rollouts = {r["rollout_id"]: r for r in run["rollouts"]}
    assert {r["task"]["input"]["dataset"] for r in rollouts.values()} == {"facts"}
    last_call, calls = {}, Counter()
    for s in run["spans"]:  # spans are stored in the order they ended
        if s["name"] == "llm.call":
            last_call[s["rollout_id"]] = s["attributes"]
            calls[s["rollout_id"]] += 1
    for s in run["spans"]:
        if s["name"] != "rollout":
            continue
        rollout, answer, last = rollouts[s["rollout_id"]], s["attributes"]["answer"], last_call[s["rollout_id"]]
        assert rollout["reward"] == rag.reward({**rollout["task"]["input"], **rollout["task"]["reference"]}, answer)
        if rollout["status"] == "failed":  # the SDK refuses a reply cut off at max_tokens (response.incomplete)
            assert last["gen_ai.response.finish_reasons"] == ["length"] and "incomplete" in s["attributes"]["error"]
        elif answer is None:  # out of turns: the model still searching at the last call the agent allows
            assert calls[s["rollout_id"]] == rag.MAX_TURNS
        else:  # the SDK's final output: the text of the model's last reply
            assert answer == last["lightning_ray.response"]
