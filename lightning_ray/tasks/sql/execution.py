"""Running a model's SQL safely, and execution match against a gold query.

A query runs read-only three times over: the file is opened in SQLite's read-only URI mode (`mode=ro`, nothing is
created or written), the connection is `PRAGMA query_only`, and an authorizer allows reading and nothing else (no
ATTACH, PRAGMA, writes or schema changes). A progress handler ends a query past its time limit (a runaway recursive
CTE, a cross join of big tables), and results are capped in rows and value size. Whatever goes wrong is a
`QueryError`: the agent shows it to its checker, the reward counts it as a miss; nothing here raises anything else
or hangs. Only a gold query that does not run is no miss of the policy's: the reward raises `GoldQueryFailed`, and
the attempt is the platform's failure, not trained on. The tasks hold gold queries that run where they were made
(`gold_runs`): one that fails in a rollout does so on its node (its database missing there, the time limit under
load).
"""

from __future__ import annotations

import math
import re
import sqlite3
import time
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from lightning_ray.rollout.runner import PlatformFailure

TIME_LIMIT_S = 2.0  # per query; Chinook's and Spider's gold queries take milliseconds
MAX_ROWS = 10_000  # a result longer than this is not an answer to a question
MAX_VALUE_BYTES = 1_000_000  # SQLITE_LIMIT_LENGTH: bounds zeroblob/printf/group_concat blow-ups
MAX_RESULT_BYTES = 16_000_000  # a whole result's text and blobs: 10,000 rows of 1 MB values took 2.5 GB in 2 s
_FETCH = 16  # rows fetched at a time, their size counted: 16 MB at most (MAX_VALUE_BYTES each) before a check
_PROGRESS_EVERY = 1_000  # virtual machine instructions between deadline checks (~µs)
# One LIKE is one instruction, its time the value's length times the pattern's: 10 kB of pattern against a 1 MB value
# took 14 s past a 2 s limit; 256 bytes take 0.3 s at most. Questions' patterns are words ('%Rock%').
MAX_LIKE_PATTERN_BYTES = 256
_REFUSED_FUNCTIONS = {"fts3_tokenizer"}  # hands out (and takes) a raw pointer

# Reading is all a query may do: the action codes SQLite asks the authorizer about for a SELECT.
_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}


class QueryError(Exception):
    """The query did not run to a result: a syntax error, a refused write, the time or row limit, ..."""


class GoldQueryFailed(PlatformFailure):
    """The gold query did not run (no database file at its path on this node, a time limit under load): the
    reward cannot say whether the answer is right."""


@dataclass(frozen=True)
class Result:
    columns: tuple[str, ...]
    rows: tuple[tuple, ...]
    tables: frozenset[str] = frozenset()  # the database's tables the query read (SQLite's own sqlite_* left out)


def execute(db_path: str | Path, sql: str, time_limit_s: float = TIME_LIMIT_S, max_rows: int = MAX_ROWS) -> Result:
    """Run one read-only statement on the SQLite file and return its rows, or raise QueryError."""
    path = Path(db_path).expanduser().resolve()
    if not path.is_file():  # mode=ro would not create it, but say so plainly
        raise QueryError(f"no database file at {path}")
    try:
        conn = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
    except sqlite3.Error as e:
        raise QueryError(f"cannot open {path}: {e}") from None
    try:
        conn.execute("PRAGMA query_only = ON")
        tables: set[str] = set()

        def authorize(action: int, table: str | None, name: str | None, *_) -> int:
            if action == sqlite3.SQLITE_READ and not table.startswith("sqlite_"):
                tables.add(table)  # asked while the statement is prepared, for each table (and column) it reads
            if action == sqlite3.SQLITE_FUNCTION and (name or "").lower() in _REFUSED_FUNCTIONS:
                return sqlite3.SQLITE_DENY
            return sqlite3.SQLITE_OK if action in _ALLOWED else sqlite3.SQLITE_DENY

        conn.set_authorizer(authorize)
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
        conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        conn.setlimit(sqlite3.SQLITE_LIMIT_LIKE_PATTERN_LENGTH, MAX_LIKE_PATTERN_BYTES)
        deadline = time.monotonic() + time_limit_s
        conn.set_progress_handler(lambda: time.monotonic() > deadline, _PROGRESS_EVERY)
        cursor = conn.execute(sql)
        if cursor.description is None:
            raise QueryError("not a query: the statement returns no rows")
        rows, size = [], 0
        while chunk := cursor.fetchmany(_FETCH):
            rows += chunk
            size += sum(len(v) for row in chunk for v in row if isinstance(v, str | bytes))
            if len(rows) > max_rows:
                raise QueryError(f"more than {max_rows} rows")
            if size > MAX_RESULT_BYTES:
                raise QueryError(f"a result of more than {MAX_RESULT_BYTES // 1_000_000} MB")
        return Result(tuple(d[0] for d in cursor.description), tuple(rows), frozenset(tables))
    except sqlite3.OperationalError as e:
        if str(e) == "interrupted":  # the progress handler's doing
            raise QueryError(f"time limit: the query ran longer than {time_limit_s:g} s") from None
        raise QueryError(str(e)) from None
    except (sqlite3.Error, ValueError, OverflowError, MemoryError) as e:  # ValueError: a NUL in the text
        raise QueryError(f"{type(e).__name__}: {e}") from None
    finally:
        conn.close()


def execution_match(db_path: str | Path, predicted: str | None, gold: str, time_limit_s: float = TIME_LIMIT_S) -> float:
    """1.0 when the predicted query returns the gold query's result, else 0.0 (also for any error of its);
    GoldQueryFailed where the gold query does not run.

    Results are compared as multisets of rows, or as lists when the gold query orders its outer result (ORDER BY
    outside any subquery). Column names do not matter, column order does; numbers compare by value rounded to
    6 decimals (2 equals 2.0; a sum added in another order still matches)."""
    try:
        ordered, expected = _gold_result(str(Path(db_path).expanduser().resolve()), gold, time_limit_s)
    except QueryError as e:
        raise GoldQueryFailed(f"the gold query did not run: {e}") from None
    if not predicted or not predicted.strip():
        return 0.0
    try:
        got = _normalized(execute(db_path, predicted, time_limit_s).rows)
    except QueryError:
        return 0.0
    return float(got == expected if ordered else Counter(got) == Counter(expected))


def gold_runs(db_path: str | Path, gold: str, time_limit_s: float = TIME_LIMIT_S) -> bool:
    """Whether the gold query runs to a result within the limits (Spider has some of over MAX_ROWS rows)."""
    try:
        _gold_result(str(Path(db_path).expanduser().resolve()), gold, time_limit_s)
    except QueryError:
        return False
    return True


@lru_cache(maxsize=4096)
def _gold_result(db_path: str, gold: str, time_limit_s: float) -> tuple[bool, tuple[tuple, ...]]:
    # GRPO runs every task group_size times: its gold query once per process is enough.
    return orders_result(gold), _normalized(execute(db_path, gold, time_limit_s).rows)


def _normalized(rows) -> tuple[tuple, ...]:
    return tuple(tuple(_value(v) for v in row) for row in rows)


def _value(v):
    if isinstance(v, (int, float)):
        return round(float(v), 6) if math.isfinite(v) else str(v)
    return v


_STRING = re.compile(r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"")
_INNERMOST = re.compile(r"\([^()]*\)")
_ORDER_BY = re.compile(r"\border\s+by\b", re.IGNORECASE)


def orders_result(sql: str) -> bool:
    """Whether the query orders its outer result: ORDER BY outside string literals and parentheses."""
    text = _STRING.sub("''", sql)
    while (shorter := _INNERMOST.sub(" ", text)) != text:
        text = shorter
    return bool(_ORDER_BY.search(text))
