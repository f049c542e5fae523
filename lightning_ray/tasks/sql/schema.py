"""A database's schema as the agent's prompt shows it: one line per table, foreign keys inline and short, as a small
model's context allows.

    Album(AlbumId, Title, ArtistId -> Artist.ArtistId)
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

Tables = list[tuple[str, list[str]]]  # (table, its columns), in order
ForeignKeys = dict[tuple[str, str], tuple[str, str]]  # (table, column) -> the (table, column) it refers to


def render(tables: Tables, foreign_keys: ForeignKeys) -> str:
    def column(table: str, name: str) -> str:
        ref = foreign_keys.get((table, name))
        return f"{name} -> {ref[0]}.{ref[1]}" if ref else name

    return "\n".join(f"{t}({', '.join(column(t, c) for c in cols)})" for t, cols in tables)


def from_sqlite(db_path: str | Path) -> str:
    """The schema of an SQLite file (its tables in creation order), read without writing anything."""
    conn = sqlite3.connect(Path(db_path).resolve().as_uri() + "?mode=ro", uri=True)
    try:
        names = [r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY rowid")]
        tables = [(t, [r[1] for r in conn.execute("SELECT * FROM pragma_table_info(?)", (t,))]) for t in names]
        foreign_keys = {(t, r[3]): (r[2], r[4] or r[3]) for t in names
                        for r in conn.execute("SELECT * FROM pragma_foreign_key_list(?)", (t,))}
    finally:
        conn.close()
    return render(tables, foreign_keys)
