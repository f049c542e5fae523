"""The rag task: multi-hop question answering by an OpenAI Agents SDK agent with a retrieval tool.

The agent (`agent` below) is ordinary Agents SDK code: an Agent with one function tool, `search`, run by the SDK's
Runner on its default API, the Responses API, against the base URL it is given. It knows nothing of training.
`search` ranks the task's corpus by cosine similarity of all-MiniLM-L6-v2 embeddings (retrieval.py, offline).

Datasets (`task.dataset`):
- `facts`: questions about a generated world of invented people, companies, cities and countries (world.py), so
  that no answer is in any model's memory: "In which country was Delste Burme born?" takes two searches, where
  Delste Burme was born and then where that city is. Options (`task.generator`): `people` (the world's size,
  default 500; the questions number people × templates), `world_seed` (default 0), `templates` (default
  birth_country and employer_city, two hops; employer_country has three). Every question searches the same corpus,
  the world's facts.
- `musique`: MuSiQue's jsonl layout (musique.py); option `path`, the file. Each question searches its own
  paragraphs (MuSiQue's distractor setting).
The training and held-out splits are drawn from the same pool with different seeds; no held-out question is in
the training split (`exclude`).

The agent opens the conversation with one worked example: two searches, then the answer line.

The reward is FORMAT_WEIGHT (0.1) for a reply with an `ANSWER: <answer>` line (the colon may be left out, as the
calc task writes it), plus F1_WEIGHT (0.9) × the token F1 of the answer against the gold answer or its best-matching
alias, after SQuAD's normalization (lower case, no punctuation, no articles). The answer is the last ANSWER line's
text, or the whole reply when it has none.
"""

from __future__ import annotations

import json
import random
import re
import string
import threading
from collections import Counter
from functools import lru_cache

from lightning_ray.tasks import checked_options
from lightning_ray.tasks.rag.musique import read_musique
from lightning_ray.tasks.rag.retrieval import CACHE_DIR, Index
from lightning_ray.tasks.rag.world import DEFAULT_TEMPLATES, TEMPLATES, make_world
from lightning_ray.tasks.tls import tls_context
from lightning_ray.tracing import emit_tool
from lightning_ray.types import Task

_OPTIONS = {"facts": {"people", "world_seed", "templates"}, "musique": {"path"}}
# the gold answers and the path to them: the reward's and the demonstrations', never the agent's (Task.reference)
REFERENCE = ("answers", "supporting", "decomposition")
FORMAT_WEIGHT, F1_WEIGHT = 0.1, 0.9
TOP_K = 3  # passages per search
MAX_TURNS = 4  # model calls per episode: a search per hop, the answer, and one spare
INSTRUCTIONS = ("Answer the question with facts from the search tool. Search for one fact at a time: first about "
                "the person or thing the question names, then about what you found. Then reply with one line: "
                "ANSWER: <answer>")

# One worked example, as earlier turns of the conversation (the calc agent opens the same way: a small model follows
# a conversation's pattern more readily than its instructions). Its people and places are in no generated world.
EXAMPLE = ("In which country was Amel Dorn born?",
           [("Where was Amel Dorn born?",
             ["Amel Dorn was born in Kestmor.", "Amel Dorn works for Vellin Mills.",
              "Ravi Dorst was born in Lunheim."]),
            ("In which country is Kestmor?",
             ["Kestmor is a city in Zalia.", "Tomas Hale was born in Kestmor.", "Lunheim is a city in Brontara."])],
           "Zalia")
# The answer line: ANSWER, a colon (optional, as the calc task writes it: "ANSWER 7"), the answer.
_ANSWER = re.compile(r"^[ \t]*ANSWER(?::|[ \t])[ \t]*(\S.*?)[ \t]*$", re.M)


def make_tasks(n: int, seed: int, dataset: str = "facts", options: dict | None = None, protocol: str = "tools",
               exclude: set[str] = frozenset()) -> list[Task]:
    """n questions, none of them in `exclude`, in an order drawn by `seed`. Deterministic for the same arguments."""
    if protocol != "tools":
        raise ValueError(f"protocol {protocol!r}: the rag agent searches through a function tool (task.protocol=tools)")
    options = checked_options("rag", dataset, options, _OPTIONS)
    if dataset == "facts":
        pool = _facts(int(options.get("people", 500)), int(options.get("world_seed", 0)),
                      _names(options.get("templates", DEFAULT_TEMPLATES)))
    elif "path" not in options:
        raise ValueError("the rag task's musique dataset needs task.generator.path: a MuSiQue jsonl file")
    else:
        pool = [{**r, "dataset": "musique"} for r in read_musique(options["path"])]
    order = list(range(len(pool)))
    random.Random(seed).shuffle(order)
    tasks: list[Task] = []
    seen = set(exclude)
    for i in order:
        entry = pool[i]
        if entry["question"] in seen:
            continue
        seen.add(entry["question"])
        tasks.append(Task(task_id=entry.pop("id", None) or f"{dataset}-{seed}-{len(tasks)}",
                          input={k: v for k, v in entry.items() if k not in REFERENCE},
                          reference={k: entry[k] for k in REFERENCE if k in entry}))
        if len(tasks) == n:
            return tasks
    more = "a larger world: task.generator.people" if dataset == "facts" else "a larger file"
    raise ValueError(f"the rag task's {dataset} has {len(tasks)} questions outside `exclude`; {n} were asked for "
                     f"(a smaller task.train_size / eval_size, or {more})")


def _names(value: str | list[str]) -> tuple[str, ...]:
    """A list option given one name as text (templates=birth_country on the command line): that name, not its
    letters."""
    return (value,) if isinstance(value, str) else tuple(value)


def _facts(people: int, world_seed: int, templates: tuple[str, ...]) -> list[dict]:
    if unknown := set(templates) - set(TEMPLATES):
        raise ValueError(f"unknown template(s): {', '.join(sorted(unknown))} (expected some of {', '.join(TEMPLATES)})")
    world = make_world(world_seed, people)
    position = {text: i for i, text in enumerate(world.documents)}
    return [{"question": q.text, "answers": [q.answer], "dataset": "facts", "template": q.template,
             "world": {"seed": world_seed, "people": people},
             "supporting": [position[f.text] for f in q.hops], "decomposition": q.decomposition}
            for q in world.questions(templates)]


def documents(task: dict) -> list[str]:
    """The corpus the task's questions are answered from: the world's facts, or the question's own paragraphs."""
    if task["dataset"] == "facts":
        return make_world(task["world"]["seed"], task["world"]["people"]).documents
    return [f"{p['title']}: {p['text']}" for p in task["paragraphs"]]


_building = threading.Lock()  # agents run in threads: one builds an index while the others wait for it


def index(task: dict) -> Index:
    with _building:
        if task["dataset"] == "facts":
            return _world_index(task["world"]["seed"], task["world"]["people"])
        return _paragraph_index(tuple(documents(task)))


@lru_cache(maxsize=4)
def _world_index(seed: int, people: int) -> Index:
    return Index.build(make_world(seed, people).documents, cache_dir=CACHE_DIR)  # embedded once per machine


@lru_cache(maxsize=64)  # a GRPO group's rollouts of one question run close together
def _paragraph_index(paragraphs: tuple[str, ...]) -> Index:
    return Index.build(list(paragraphs))


def agent(task: dict, base_url: str, model: str, api_key: str = "EMPTY") -> str | None:
    """An Agents SDK agent that searches and answers; returns its final reply (None if it ran out of turns)."""
    from agents import Agent, MaxTurnsExceeded, OpenAIResponsesModel, RunConfig, Runner
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient

    # an async client is bound to this rollout's event loop (run_sync's): a new one per rollout, on the shared TLS context
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                         http_client=DefaultAsyncHttpxClient(verify=tls_context()))
    researcher = Agent(name="researcher", instructions=system_prompt(task), tools=[search_tool(index(task))],
                       model=OpenAIResponsesModel(model=model, openai_client=client))
    # offline: no traces to OpenAI's backend; a tool name the model made up is answered as an error, not raised
    config = RunConfig(tracing_disabled=True, tool_not_found_behavior="return_error_to_model")
    conversation = [*opening(), {"role": "user", "content": task["question"]}]
    try:
        return Runner.run_sync(researcher, conversation, max_turns=MAX_TURNS, run_config=config).final_output
    except MaxTurnsExceeded:
        return None


def system_prompt(task: dict) -> str:
    """The agent's instructions: INSTRUCTIONS, unless the run gave its own (task.system_prompt)."""
    return task.get("system_prompt") or INSTRUCTIONS


def search_tool(corpus: Index):
    """The agent's one tool: an SDK function tool named `search` over the corpus."""
    from agents import function_tool
    from agents.tool_context import ToolContext

    def search(context, query: str) -> str:
        """Search the knowledge base. Returns the passages most relevant to the query, one per line."""
        result = "\n".join(corpus.search(query, TOP_K))
        # the tool call as a span, for AIR (no-op outside a rollout); its id names the call that asked for it
        emit_tool("search", {"query": query}, result, call_id=context.tool_call_id)
        return result

    search.__annotations__["context"] = ToolContext  # how the SDK knows to pass it (and leave it out of the schema)
    return function_tool(search)


def opening() -> list[dict]:
    """The worked example as Responses input items: the question, each search as a function call and its output,
    the answer."""
    question, searches, answer = EXAMPLE
    items: list[dict] = [{"role": "user", "content": question}]
    for i, (query, passages) in enumerate(searches):
        items += _searched(f"call_example_{i}", query, passages)
    return [*items, {"role": "assistant", "content": f"ANSWER: {answer}"}]


def oracle(task: dict, messages: list[dict], tools: list[dict] | None) -> dict:
    """The imitation teacher's answer (serving/teacher.py, teacher.kind=oracle): a search for each hop of the
    question's decomposition in turn (where the reference has one), then the answer line with the gold answer."""
    asked = max(i for i, m in enumerate(messages) if m["role"] == "user")
    searched = sum(m["role"] == "tool" for m in messages[asked:])
    hops = task.get("decomposition") or []
    if searched < len(hops):
        return {"content": None, "tool_calls": [{"id": f"call_oracle_{searched}", "type": "function", "function": {
            "name": "search", "arguments": json.dumps({"query": hops[searched]})}}]}
    return {"content": f"ANSWER: {task['answers'][0]}"}


def demonstrations(tasks: list[Task]) -> list[list[dict]]:
    """Correct episodes as the agent's Responses input items: the opening, the question, a search per hop (the
    question's decomposition, answered by the real index) and the answer line. They warm up the tiny test model."""
    out = []
    for t in tasks:
        corpus, items = index(t.input), [*opening(), {"role": "user", "content": t.input["question"]}]
        for i, query in enumerate(t.reference["decomposition"]):
            items += _searched(f"call_{i}", query, corpus.search(query, TOP_K))
        out.append([*items, {"role": "assistant", "content": f"ANSWER: {t.reference['answers'][0]}"}])
    return out


def _searched(call_id: str, query: str, passages: list[str]) -> list[dict]:
    return [{"type": "function_call", "call_id": call_id, "name": "search", "arguments": json.dumps({"query": query})},
            {"type": "function_call_output", "call_id": call_id, "output": "\n".join(passages)}]


def normalize(text: str) -> str:
    """SQuAD's answer normalization: lower case, punctuation and the articles a/an/the removed, spaces collapsed."""
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def f1(prediction: str, gold: str) -> float:
    """Token-level F1 of the normalized strings (1.0 when both normalize to nothing)."""
    predicted, expected = normalize(prediction).split(), normalize(gold).split()
    if not predicted or not expected:
        return float(predicted == expected)
    same = sum((Counter(predicted) & Counter(expected)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted), same / len(expected)
    return 2 * precision * recall / (precision + recall)


def parse_answer(reply: str) -> str | None:
    """The text of the reply's last `ANSWER: ...` line, or None if it has none."""
    found = _ANSWER.findall(reply)
    return found[-1] if found else None


def reward(task: dict, answer: str | None) -> float:
    """FORMAT_WEIGHT × (an ANSWER line) + F1_WEIGHT × the best F1 against the gold answer and its aliases."""
    if answer is None:
        return 0.0
    parsed = parse_answer(answer)
    score = max(f1(answer if parsed is None else parsed, gold) for gold in task["answers"])
    return FORMAT_WEIGHT * (parsed is not None) + F1_WEIGHT * score
