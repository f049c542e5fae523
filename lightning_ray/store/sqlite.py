"""The durable backend: one SQLite file in WAL mode. Spans are idempotent on span_id."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from lightning_ray.types import Rollout, Span, Task

_SCHEMA = """
CREATE TABLE IF NOT EXISTS rollouts (
    rollout_id TEXT PRIMARY KEY, task TEXT NOT NULL, status TEXT NOT NULL,
    attempt_id TEXT, reward REAL, error TEXT, seq INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS rollouts_status ON rollouts(status, seq);
CREATE TABLE IF NOT EXISTS spans (
    span_id TEXT PRIMARY KEY, rollout_id TEXT, attempt_id TEXT, name TEXT NOT NULL,
    start_time REAL NOT NULL, end_time REAL, attributes TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS spans_rollout ON spans(rollout_id, start_time);
"""


class SQLiteBackend:
    def __init__(self, path: str | Path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across process crashes
        self.db.executescript(_SCHEMA)

    def add_rollouts(self, rollouts: list[Rollout]) -> None:
        (seq,) = self.db.execute("SELECT COALESCE(MAX(seq), 0) FROM rollouts").fetchone()
        with self.db:
            self.db.executemany(
                "INSERT INTO rollouts VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(r.rollout_id, r.task.model_dump_json(), r.status, r.attempt_id, r.reward, r.error, seq + i + 1)
                 for i, r in enumerate(rollouts)],
            )

    def claim_next(self, attempt_id_for) -> Rollout | None:
        """Atomically move the oldest queued rollout to running."""
        with self.db:
            row = self.db.execute("SELECT rollout_id FROM rollouts WHERE status='queued' ORDER BY seq LIMIT 1").fetchone()
            if row is None:
                return None
            self.db.execute("UPDATE rollouts SET status='running', attempt_id=? WHERE rollout_id=?",
                            (attempt_id_for(row[0]), row[0]))
        return self.get_rollouts([row[0]])[0]

    def update_rollout(self, rollout_id: str, **fields) -> None:
        cols = ", ".join(f"{k}=?" for k in fields)
        with self.db:
            self.db.execute(f"UPDATE rollouts SET {cols} WHERE rollout_id=?", (*fields.values(), rollout_id))

    def get_rollouts(self, rollout_ids: list[str]) -> list[Rollout]:
        marks = ",".join("?" * len(rollout_ids))
        rows = self.db.execute(
            f"SELECT rollout_id, task, status, attempt_id, reward, error FROM rollouts WHERE rollout_id IN ({marks})",
            rollout_ids).fetchall()
        by_id = {r[0]: Rollout(rollout_id=r[0], task=Task.model_validate_json(r[1]), status=r[2], attempt_id=r[3],
                               reward=r[4], error=r[5]) for r in rows}
        return [by_id[i] for i in rollout_ids if i in by_id]

    def add_spans(self, spans: list[Span]) -> int:
        with self.db:
            cur = self.db.executemany(
                "INSERT OR IGNORE INTO spans VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(s.span_id, s.rollout_id, s.attempt_id, s.name, s.start_time, s.end_time, json.dumps(s.attributes))
                 for s in spans],
            )
        return cur.rowcount

    def get_spans(self, rollout_ids: list[str]) -> list[Span]:
        marks = ",".join("?" * len(rollout_ids))
        rows = self.db.execute(
            f"SELECT span_id, rollout_id, attempt_id, name, start_time, end_time, attributes FROM spans "
            f"WHERE rollout_id IN ({marks}) ORDER BY start_time", rollout_ids).fetchall()
        return [Span(span_id=r[0], rollout_id=r[1], attempt_id=r[2], name=r[3], start_time=r[4], end_time=r[5],
                     attributes=json.loads(r[6])) for r in rows]

    def count_spans(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM spans").fetchone()[0]
