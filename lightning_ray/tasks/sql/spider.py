"""Spider (Yu et al., 2018) in its released layout, for the sql task:

    <root>/tables.json                      one entry per database: db_id, table_names_original,
                                            column_names_original [[table index, column], ...] (index -1: "*"),
                                            foreign_keys [[column index, referenced column index], ...]
    <root>/train_spider.json, dev.json, ... questions: [{"db_id", "question", "query", ...}, ...]
    <root>/database/<db_id>/<db_id>.sqlite  the databases

Spider is not on this machine; the loader is tested on a small tree in the same layout. BIRD and other datasets in
this layout load the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lightning_ray.tasks.sql import schema


@dataclass(frozen=True)
class Example:
    db_id: str
    question: str
    gold: str  # the gold SQL
    db_path: Path
    schema: str  # as the agent's prompt shows it (schema.render)


def load_schemas(root: str | Path) -> dict[str, str]:
    """Each database's schema text, from tables.json."""
    out = {}
    for db in json.loads((Path(root) / "tables.json").read_text(encoding="utf-8")):
        tables = db["table_names_original"]
        columns = db["column_names_original"]
        by_table: list[tuple[str, list[str]]] = [(t, []) for t in tables]
        for table_index, name in columns:
            if table_index >= 0:  # -1 is Spider's "*"
                by_table[table_index][1].append(name)
        foreign_keys = {}
        for col, ref in db.get("foreign_keys", []):
            (t, c), (rt, rc) = columns[col], columns[ref]
            foreign_keys[tables[t], c] = (tables[rt], rc)
        out[db["db_id"]] = schema.render(by_table, foreign_keys)
    return out


def load(root: str | Path, questions: str | list[str] = "dev.json") -> list[Example]:
    """The examples of one or more question files under `root`, in file order. An example whose database file is
    missing is an error (a partial download), named with its db_id."""
    root = Path(root).expanduser().resolve()
    schemas = load_schemas(root)
    out = []
    for name in [questions] if isinstance(questions, str) else questions:
        for item in json.loads((root / name).read_text(encoding="utf-8")):
            db_id = item["db_id"]
            db_path = root / "database" / db_id / f"{db_id}.sqlite"
            if db_id not in schemas:
                raise ValueError(f"{name}: database {db_id!r} is not in tables.json")
            if not db_path.is_file():
                raise FileNotFoundError(f"{name}: no database file for {db_id!r} at {db_path}")
            out.append(Example(db_id, item["question"].strip(), item["query"].strip(), db_path, schemas[db_id]))
    return out
