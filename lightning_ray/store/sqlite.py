"""The store's one backend: SQLite in WAL mode inside the run directory, or ":memory:" for tests.

Every rollout/attempt state change is one transaction checked against lifecycle.py. Spans travel as rows that the
sender encoded (attributes and events as JSON bytes, numeric lists packed: rows.span_row), so the single store process
only validates and inserts; they are idempotent on (rollout_id, span_id), so a re-sent batch is never duplicated and
two rollouts' spans never collide.
"""

from __future__ import annotations

import math
import operator
import sqlite3
from contextlib import contextmanager
from pathlib import Path

from lightning_ray.store.errors import (InvalidReward, InvalidTransition, StaleAttempt, StoreError, UnknownAttempt,
                                       UnknownRollout)
from lightning_ray.store.lifecycle import check_move
from lightning_ray.store.prompt_chain import PromptChain, restore
from lightning_ray.store.rows import (attempt_of, attempt_policy, attempt_row, rollout_of, rollout_row, row_problem,
                                      span_from_row)
from lightning_ray.types import FINISHED, Attempt, CancelOutcome, Rollout, Span, Verdict, new_id

_SCHEMA = """
CREATE TABLE IF NOT EXISTS rollouts (
    rollout_id TEXT PRIMARY KEY, seq INTEGER NOT NULL, task TEXT NOT NULL, config TEXT NOT NULL,
    status TEXT NOT NULL, attempt_id TEXT, attempts INTEGER NOT NULL, reward REAL, error TEXT,
    enqueued_at REAL NOT NULL, ended_at REAL, queue TEXT NOT NULL DEFAULT 'default');
CREATE INDEX IF NOT EXISTS rollouts_by_status ON rollouts(status, seq);
CREATE INDEX IF NOT EXISTS rollouts_by_queue ON rollouts(status, queue, seq);
CREATE INDEX IF NOT EXISTS rollouts_by_time ON rollouts(enqueued_at);
CREATE INDEX IF NOT EXISTS rollouts_by_seq ON rollouts(seq);
CREATE TABLE IF NOT EXISTS attempts (
    attempt_id TEXT PRIMARY KEY, rollout_id TEXT NOT NULL, sequence INTEGER NOT NULL, status TEXT NOT NULL,
    worker_id TEXT, started_at REAL NOT NULL, last_heartbeat REAL NOT NULL, ended_at REAL, error TEXT,
    deadline REAL, lease_until REAL);
CREATE INDEX IF NOT EXISTS attempts_by_rollout ON attempts(rollout_id, sequence);
CREATE INDEX IF NOT EXISTS attempts_by_status ON attempts(status);
CREATE TABLE IF NOT EXISTS span_db.spans (
    span_id TEXT NOT NULL, trace_id TEXT, parent_id TEXT, rollout_id TEXT, attempt_id TEXT, name TEXT NOT NULL,
    start_time REAL NOT NULL, end_time REAL, status TEXT NOT NULL, status_message TEXT,
    attributes BLOB NOT NULL, events BLOB NOT NULL, origin TEXT NOT NULL DEFAULT 'client', arrays BLOB,
    prompt_base TEXT);
CREATE UNIQUE INDEX IF NOT EXISTS span_db.spans_key ON spans(IFNULL(rollout_id, ''), span_id);
CREATE INDEX IF NOT EXISTS span_db.spans_by_rollout ON spans(rollout_id, start_time);
CREATE INDEX IF NOT EXISTS span_db.spans_by_time ON spans(start_time);
"""
WAL_SIZE_LIMIT = 16 << 20  # bytes a WAL file keeps after a checkpoint; between checkpoints it reuses its space
_ROLLOUT_COLS = ("rollout_id, task, config, status, attempt_id, attempts, reward, error, enqueued_at, ended_at, "
                 "queue")
_ATTEMPT_COLS = "attempt_id, rollout_id, sequence, status, worker_id, started_at, last_heartbeat, ended_at, error"
_SPAN_COLS = ("span_id, trace_id, parent_id, rollout_id, attempt_id, name, start_time, end_time, status, "
              "status_message, attributes, events, arrays, origin")
_by_time = operator.itemgetter(6, 15)  # start_time, rowid
_ORIGINS = ("server", "client")


class SQLiteBackend:
    """A shard's durable storage: store/protocol.py's operations as TraceStore calls them, on one SQLite thread, the
    clock passed in (`now`); waiting, error counts and span ingest (add_span_rows) are the actor's."""

    def __init__(self, path: str | Path = ":memory:"):
        """The queue lives in `path`, the spans beside it in `<stem>-spans.sqlite`: spans are ~10 KB rows that
        want 64 KB pages (no overflow chains: 3-4x faster inserts), while the queue's small transactions want small
        pages (64 KB pages made each dequeue 3x slower)."""
        spans_path = ":memory:"
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            spans_path = str(Path(path).with_name(f"{Path(path).stem}-spans.sqlite"))
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.db.execute("ATTACH DATABASE ? AS span_db", (spans_path,))
        self.db.execute("PRAGMA span_db.page_size=65536")  # before the file's first table: fixed from then on
        for schema in ("main", "span_db"):
            self.db.execute(f"PRAGMA {schema}.journal_mode=WAL")
            self.db.execute(f"PRAGMA {schema}.synchronous=NORMAL")  # WAL + NORMAL: a commit survives a crash
        columns = {c[1] for c in self.db.execute("PRAGMA span_db.table_info(spans)")}
        if columns and "origin" not in columns:  # a spans file from before origins were recorded
            self.db.execute("ALTER TABLE span_db.spans ADD COLUMN origin TEXT NOT NULL DEFAULT 'client'")
        if columns and "arrays" not in columns:  # from before arrays were packed: its rows read as before (NULL)
            self.db.execute("ALTER TABLE span_db.spans ADD COLUMN arrays BLOB")
        if columns and "prompt_base" not in columns:  # from before prompts were chained: every prompt whole
            self.db.execute("ALTER TABLE span_db.spans ADD COLUMN prompt_base TEXT")
        columns = {c[1] for c in self.db.execute("PRAGMA main.table_info(rollouts)")}
        if columns and "queue" not in columns:  # a queue file from before queues: every rollout in "default"
            self.db.execute("ALTER TABLE rollouts ADD COLUMN queue TEXT NOT NULL DEFAULT 'default'")
        self.db.executescript(_SCHEMA)
        self.prompt_chain = PromptChain()
        self.last_cut = float("-inf")  # delete_spans' last `before`: spans of rollouts enqueued before it are gone
        # A checkpoint (copying the WAL into the file, with an fsync) would stall the write that crosses the
        # threshold; `checkpoint` does them from other connections and another thread instead. This pragma holds
        # for the whole connection, both files, whatever schema it names: so both are checkpointed there.
        self.db.execute("PRAGMA wal_autocheckpoint=0")
        self._checkpointers = [] if spans_path == ":memory:" else [
            sqlite3.connect(p, isolation_level=None, check_same_thread=False) for p in (str(path), spans_path)]
        for schema in ("main", "span_db"):  # a WAL that once grew (a burst of spans) is cut back when it restarts
            self.db.execute(f"PRAGMA {schema}.journal_size_limit={WAL_SIZE_LIMIT}")

    def checkpoint(self) -> None:
        """Move both WALs into their files without blocking the writer (call from any thread but the writer's)."""
        for c in self._checkpointers:
            c.execute("PRAGMA wal_checkpoint(PASSIVE)")

    @contextmanager
    def _transaction(self):
        """One atomic, durable step (the connection is in autocommit mode, so BEGIN explicitly)."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # --- rollouts and attempts -------------------------------------------------------------------------------

    def enqueue(self, rollouts: list[Rollout]) -> int:
        """Queue new rollouts; ids already present are ignored (a re-sent enqueue is not duplicated)."""
        return self.enqueue_rows([rollout_row(r) for r in rollouts])

    def enqueue_rows(self, rows: list[tuple]) -> int:
        """`enqueue`, each rollout as its row (rollout_row)."""
        for r in rows:
            if r[3] != "queued" or r[5]:
                raise InvalidTransition(f"rollout {r[0]} must enter the store as queued, not {r[3]!r}")
        with self._transaction():
            (seq,) = self.db.execute("SELECT COALESCE(MAX(seq), 0) FROM rollouts").fetchone()
            return self.db.executemany(
                f"INSERT OR IGNORE INTO rollouts (seq, {_ROLLOUT_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [(seq + i + 1, *r) for i, r in enumerate(rows)]).rowcount

    def dequeue(self, worker_id: str | None, now: float, attempt_id: str | None = None,
                queue: str = "default") -> tuple[Rollout, Attempt] | None:
        """Lease the oldest rollout waiting in `queue` to a new attempt (queued or requeued → running). The caller
        may name the attempt: asking again under that name (its reply was lost) gets the same lease back."""
        with self._transaction():
            if attempt_id is not None and (again := self.leased(attempt_id)):
                return again
            if not (heads := self._heads(queue, 1)):
                return None
            [(row, attempt)] = self._lease([(attempt_id or new_id("at"), heads[0])], worker_id, now)
            return rollout_of(row), attempt

    def dequeue_batch(self, worker_id: str | None, now: float, attempt_ids: list[str],
                      queue: str = "default") -> list[tuple[Rollout, Attempt] | None]:
        """`dequeue` for each attempt id, in one transaction: an id asked again gets its lease back, one whose attempt
        already ended gets None, the new ones lease the queue's oldest rollouts in order (None once it is empty)."""
        return [lease and (rollout_of(lease[0]), lease[1])
                for lease in self.dequeue_rows(worker_id, now, attempt_ids, queue)]

    def dequeue_rows(self, worker_id: str | None, now: float, attempt_ids: list[str],
                     queue: str = "default") -> list[tuple[tuple, Attempt] | None]:
        """`dequeue_batch`, each rollout as its row (rollout_of builds it)."""
        with self._transaction():
            known = self._attempts(attempt_ids)
            rows = self._rollout_rows([a.rollout_id for a, _ in known.values() if a.status == "running"])
            out = {a: (rows[attempt.rollout_id], attempt) if attempt.status == "running" else None
                   for a, (attempt, _) in known.items()}
            new = [a for a in dict.fromkeys(attempt_ids) if a not in out]
            leases = list(zip(new, self._heads(queue, len(new))))
            out.update(zip((a for a, _ in leases), self._lease(leases, worker_id, now)))
        return [out.get(a) for a in attempt_ids]

    def _heads(self, queue: str, n: int) -> list[tuple]:
        """The n oldest rollouts waiting in `queue` (queued or requeued), oldest first."""
        if n <= 0:
            return []
        # one indexed lookup per waiting status (an IN over both would sort the whole queue on every dequeue)
        heads = [row for status in ("queued", "requeued") for row in self.db.execute(
            f"SELECT seq, {_ROLLOUT_COLS} FROM rollouts WHERE status=? AND queue=? ORDER BY seq LIMIT ?",
            (status, queue, n))]
        return [row[1:] for row in sorted(heads)[:n]]

    def _lease(self, leases: list[tuple[str, tuple]], worker_id: str | None,
               now: float) -> list[tuple[tuple, Attempt]]:
        """Each (attempt id, rollout row) leased: the rollout to a new attempt of that id, as its new row; call inside
        a transaction. The rows' writes go as one statement each."""
        out, attempts, moves = [], [], []
        for attempt_id, row in leases:
            check_move("rollout", row[0], row[3], "running")
            row = (*row[:3], "running", attempt_id, row[5] + 1, *row[6:])
            cfg = attempt_policy(row[2])
            attempt = Attempt(attempt_id=attempt_id, rollout_id=row[0], sequence=row[5], worker_id=worker_id,
                              started_at=now, last_heartbeat=now)
            attempts.append((*attempt_row(attempt), cfg.timeout_seconds and now + cfg.timeout_seconds,
                             cfg.unresponsive_seconds and now + cfg.unresponsive_seconds))
            moves.append((attempt_id, attempt.sequence, row[0]))
            out.append((row, attempt))
        self.db.executemany(
            f"INSERT INTO attempts ({_ATTEMPT_COLS}, deadline, lease_until) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            attempts)
        self.db.executemany("UPDATE rollouts SET status='running', attempt_id=?, attempts=? WHERE rollout_id=?", moves)
        return out

    def leased(self, attempt_id: str) -> tuple[Rollout, Attempt] | None:
        """The rollout leased to this attempt, while it runs; None if there is no such attempt. One that ended (its
        lease ran out before the caller asked again) raises StaleAttempt: ask again under a new attempt id."""
        try:
            attempt, _ = self._attempt(attempt_id)
        except UnknownAttempt:
            return None
        if attempt.status != "running":
            raise StaleAttempt(f"attempt {attempt_id} already ended as {attempt.status}; dequeue under a new id")
        return self.get_rollouts([attempt.rollout_id])[0], attempt

    def heartbeat(self, attempt_id: str, now: float, rollout_id: str | None = None) -> Attempt:
        attempt, lease = self._attempt(attempt_id, rollout_id)
        if attempt.status != "running":
            raise StaleAttempt(f"attempt {attempt_id} is {attempt.status}: stop working on it")
        with self._transaction():
            self.db.execute("UPDATE attempts SET last_heartbeat=?, lease_until=? WHERE attempt_id=?",
                            (now, lease and now + lease, attempt_id))
        return attempt.model_copy(update={"last_heartbeat": now})

    def finish_attempt(self, attempt_id: str, status: str, now: float, reward: float | None = None,
                       error: str | None = None, rollout_id: str | None = None) -> Rollout:
        """The worker's verdict on its attempt; decides whether the rollout ends or goes back to the queue."""
        with self._transaction():
            return self._finish(attempt_id, status, now, reward, error, rollout_id)

    def finish_attempts(self, verdicts: list[Verdict], now: float) -> list[Rollout | StoreError]:
        """`finish_attempt` for each verdict, in one transaction: each one's rollout, or the error its verdict met
        (that verdict changes nothing; the others are taken). Each verdict is checked whole before anything is
        written, against what the verdicts before it in the batch did; the writes go as one statement each."""
        return [o if isinstance(o, StoreError) else rollout_of(o) for o in self.finish_rows(verdicts, now)]

    def finish_rows(self, verdicts: list[Verdict], now: float) -> list[tuple | StoreError]:
        """`finish_attempts`, each rollout as its row (rollout_of builds it)."""
        out: list[tuple | StoreError] = []
        with self._transaction():
            attempts = self._attempts([v.attempt_id for v in verdicts])
            rows = self._rollout_rows([a.rollout_id for a, _ in attempts.values()])
            attempt_moves, rollout_moves = [], []
            for v in verdicts:
                try:
                    attempt = self._running(v.attempt_id, v.rollout_id, v.reward, attempts)
                    attempt_move, rollout_move, row = _ending(attempt, v.status, now, v.reward, v.error,
                                                              rows[attempt.rollout_id])
                except StoreError as e:
                    out.append(e)
                    continue
                attempt.status = v.status  # (read for this batch only) a second verdict on it is stale
                rows[row[0]] = row
                attempt_moves.append(attempt_move)
                rollout_moves.append(rollout_move)
                out.append(row)
            self.db.executemany(_MOVE_ATTEMPT, attempt_moves)
            self.db.executemany(_MOVE_ROLLOUT, rollout_moves)
        return out

    def _finish(self, attempt_id: str, status: str, now: float, reward: float | None, error: str | None,
                rollout_id: str | None) -> Rollout:
        return self._end_attempt(self._running(attempt_id, rollout_id, reward), status, now, reward, error)

    def _running(self, attempt_id: str, rollout_id: str | None, reward: float | None,
                 known: dict[str, tuple[Attempt, float | None]] | None = None) -> Attempt:
        """The running attempt a verdict names (from `known`, the batch's, if given), or the StoreError why not."""
        if reward is not None and not math.isfinite(reward):  # refused here, whichever path the verdict came by
            raise InvalidReward(f"reward {reward!r} is not a finite number; the attempt stays running")
        attempt, _ = self._attempt(attempt_id, rollout_id, known)
        if attempt.status != "running":
            raise StaleAttempt(f"attempt {attempt_id} already ended as {attempt.status}; its result is not taken")
        return attempt

    def expire(self, now: float) -> list[str]:
        """End running attempts past their deadline (timeout) or lease (unresponsive); return their rollout ids."""
        rows = self.db.execute(
            f"SELECT {_ATTEMPT_COLS}, deadline FROM attempts WHERE status='running' "
            "AND (deadline < ? OR lease_until < ?)", (now, now)).fetchall()
        with self._transaction():
            for row in rows:
                status = "timeout" if row[-1] is not None and row[-1] < now else "unresponsive"
                self._end_attempt(attempt_of(row[:-1]), status, now, None, f"attempt {status}")
        return [row[1] for row in rows]

    def cancel(self, rollout_ids: list[str], now: float) -> dict[str, CancelOutcome]:
        """End the rollouts that have not ended (a running attempt fails); say per rollout what happened:
        "cancelled", "already_ended" (so cancelling twice is harmless) or "unknown"."""
        outcome = dict.fromkeys(rollout_ids, "unknown")
        with self._transaction():
            for r in self.get_rollouts(list(outcome)):
                if r.status in FINISHED:
                    outcome[r.rollout_id] = "already_ended"
                    continue
                check_move("rollout", r.rollout_id, r.status, "cancelled")
                if r.status == "running":
                    attempt, _ = self._attempt(r.attempt_id)
                    self._move_attempt(attempt, "failed", now, "rollout cancelled")
                self.db.execute("UPDATE rollouts SET status='cancelled', ended_at=? WHERE rollout_id=?",
                                (now, r.rollout_id))
                outcome[r.rollout_id] = "cancelled"
        return outcome

    def _end_attempt(self, attempt: Attempt, status: str, now: float, reward: float | None,
                     error: str | None) -> Rollout:
        attempt_move, rollout_move, row = _ending(attempt, status, now, reward, error,
                                                  self._rollout_rows([attempt.rollout_id])[attempt.rollout_id])
        self.db.execute(_MOVE_ATTEMPT, attempt_move)
        self.db.execute(_MOVE_ROLLOUT, rollout_move)
        return rollout_of(row)

    def _move_attempt(self, attempt: Attempt, status: str, now: float, error: str | None) -> None:
        check_move("attempt", attempt.attempt_id, attempt.status, status)
        self.db.execute(_MOVE_ATTEMPT, (status, now, error, attempt.attempt_id))

    def _attempt(self, attempt_id: str, rollout_id: str | None = None,
                 known: dict[str, tuple[Attempt, float | None]] | None = None) -> tuple[Attempt, float | None]:
        """The attempt and its lease length; with `rollout_id`, it must be that rollout's (the HTTP path names both).
        `known`: the attempts already read (`_attempts`), instead of asking the file."""
        found = (self._attempts([attempt_id]) if known is None else known).get(attempt_id)
        if found is None or rollout_id is not None and found[0].rollout_id != rollout_id:
            raise UnknownAttempt(f"no attempt {attempt_id!r}" + (f" of rollout {rollout_id!r}" if found else ""))
        return found

    def _attempts(self, attempt_ids: list[str]) -> dict[str, tuple[Attempt, float | None]]:
        """The known ones among these attempts, with their lease lengths, in one query."""
        rows = self.db.execute(f"SELECT {_ATTEMPT_COLS}, lease_until - last_heartbeat FROM attempts WHERE attempt_id "
                               f"IN ({','.join('?' * len(attempt_ids))})", attempt_ids).fetchall()
        return {r[0]: (attempt_of(r[:-1]), r[-1]) for r in rows}

    def _rollout_rows(self, rollout_ids: list[str]) -> dict[str, tuple]:
        return {r[0]: r for r in self.db.execute(f"SELECT {_ROLLOUT_COLS} FROM rollouts WHERE rollout_id IN "
                                                 f"({','.join('?' * len(rollout_ids))})", rollout_ids)}

    def get_rollouts(self, rollout_ids: list[str], strict: bool = False) -> list[Rollout]:
        """The rollouts in the order asked; unknown ids are skipped, or raise UnknownRollout when strict."""
        by_id = {i: rollout_of(r) for i, r in self._rollout_rows(rollout_ids).items()}
        if strict and (missing := [i for i in rollout_ids if i not in by_id]):
            raise UnknownRollout(f"no rollout with id {', '.join(map(repr, missing[:5]))}")
        return [by_id[i] for i in rollout_ids if i in by_id]

    def query_rollouts(self, status: list[str] | None = None, since: float | None = None,
                       until: float | None = None, limit: int | None = None) -> list[Rollout]:
        where, args = _where(("status", status), ("enqueued_at >= ?", since), ("enqueued_at < ?", until))
        rows = self.db.execute(f"SELECT {_ROLLOUT_COLS} FROM rollouts {where} ORDER BY seq LIMIT ?",
                               (*args, -1 if limit is None else limit)).fetchall()
        return [rollout_of(r) for r in rows]

    def get_attempts(self, rollout_id: str) -> list[Attempt]:
        rows = self.db.execute(f"SELECT {_ATTEMPT_COLS} FROM attempts WHERE rollout_id=? ORDER BY sequence",
                               (rollout_id,)).fetchall()
        return [attempt_of(r) for r in rows]

    def count_rollouts(self, rollout_ids: list[str] | None = None) -> dict[str, int]:
        """Rollouts per status: all of them, or those among `rollout_ids`."""
        where, args = _where(("rollout_id", rollout_ids))
        return dict(self.db.execute(f"SELECT status, COUNT(*) FROM rollouts {where} GROUP BY status", args).fetchall())

    # --- spans -----------------------------------------------------------------------------------------------

    def add_span_rows(self, rows: list[tuple], origin: str = "client") -> dict:
        """Store valid rows as coming from `origin`, reject the rest with a reason each: {"accepted",
        "duplicates", "rejected", "errors"}."""
        if origin not in _ORIGINS:
            raise ValueError(f"origin {origin!r}: expected one of {_ORIGINS}")
        errors = [(i, p) for i, r in enumerate(rows) if (p := row_problem(r))]
        bad = {i for i, _ in errors}
        rollout_ids = list({r[3] for i, r in enumerate(rows) if i not in bad and r[3] is not None})
        known = {r for (r,) in self.db.execute(
            f"SELECT rollout_id FROM rollouts WHERE rollout_id IN ({','.join('?' * len(rollout_ids))})", rollout_ids)}
        for i, r in enumerate(rows):
            if i not in bad and r[3] is not None and r[3] not in known:
                errors.append((i, f"unknown rollout_id {r[3]!r}"))
                bad.add(i)
        good = [(*row, origin, base) for i, r in enumerate(rows) if i not in bad
                for row, base in [self.prompt_chain.shorten(r)]]
        try:
            with self._transaction():
                inserted = self.db.executemany(
                    f"INSERT OR IGNORE INTO spans ({_SPAN_COLS}, prompt_base) VALUES "
                    "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", good).rowcount if good else 0
        except BaseException:
            self.prompt_chain.forget()  # it remembers calls that are not in the file
            raise
        return {"accepted": inserted, "duplicates": len(good) - inserted, "rejected": len(bad),
                "errors": [f"span #{i}: {p}" for i, p in sorted(errors)[:10]]}

    def delete_spans(self, before: float) -> int:
        """Retention (store.keep_iterations): delete the spans of rollouts enqueued before `before`, and those that
        name no rollout and started before it; the rollouts and their attempts stay. SQLite reuses the freed pages,
        so the spans file stops growing once a run deletes as much as it adds. Returns how many spans went."""
        self.prompt_chain.forget()
        # the rollouts since the last cut, not every rollout ever stored (a 1M-rollout store took 1 s a cut); a span
        # of an older one that came late has started before that cut: it goes by its time
        with self._transaction():
            deleted = self.db.execute(
                "DELETE FROM spans WHERE rollout_id IN (SELECT rollout_id FROM rollouts WHERE enqueued_at >= ? AND "
                "enqueued_at < ?) OR start_time < ? OR (rollout_id IS NULL AND start_time < ?)",
                (self.last_cut, before, self.last_cut, before)).rowcount
        self.last_cut = max(self.last_cut, before)
        return deleted

    def query_spans(self, rollout_ids: list[str] | None = None, attempt_id: str | None = None,
                    name: str | list[str] | None = None, since: float | None = None, until: float | None = None,
                    limit: int | None = None) -> list[Span]:
        return [span_from_row(r) for r in self.query_span_rows(rollout_ids, attempt_id, name, since, until, limit)]

    def query_span_rows(self, rollout_ids: list[str] | None = None, attempt_id: str | None = None,
                        name: str | list[str] | None = None, since: float | None = None, until: float | None = None,
                        limit: int | None = None) -> list[tuple]:
        """query_spans' rows in time order, not yet decoded (span_from_row): what the store actor sends, so that the
        reader decodes them, not the store, and Ray pickles a few bytes objects per span, not its lists. `name`: one
        span name or a list of them (the trainer reads only the kinds it adapts: lightningrl.spans_read)."""
        where, args = _where(("rollout_id", rollout_ids), ("attempt_id = ?", attempt_id), ("name = ?", name),
                             ("start_time >= ?", since), ("start_time < ?", until))
        if limit is not None:
            rows = self.db.execute(f"SELECT {_SPAN_COLS}, prompt_base FROM spans {where} "
                                   "ORDER BY start_time, rowid LIMIT ?", (*args, limit)).fetchall()
        else:  # sorted here: SQLite's sorter would copy every (3-10 KB) row once more, half the fetch's time
            rows = self.db.execute(f"SELECT {_SPAN_COLS}, prompt_base, rowid FROM spans {where}", args).fetchall()
            rows.sort(key=_by_time)
        return restore([r[:14] for r in rows], [r[14] for r in rows], self._span_row)

    def _span_row(self, rollout_id: str, span_id: str) -> tuple[tuple, str | None]:
        row = self.db.execute(f"SELECT {_SPAN_COLS}, prompt_base FROM spans WHERE IFNULL(rollout_id, '') = ? "
                              "AND span_id = ?", (rollout_id, span_id)).fetchone()
        return row[:14], row[14]

    def query_spans_outside_rollouts(self) -> list[Span]:
        """Spans that name no rollout (calls to the endpoint's plain /v1, OTLP spans sent without one), in time order."""
        return [span_from_row(r) for r in self.db.execute(
            f"SELECT {_SPAN_COLS} FROM spans WHERE rollout_id IS NULL ORDER BY start_time, rowid")]

    def count_spans(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM spans").fetchone()[0]


def _where(*conditions) -> tuple[str, list]:
    """AND together the conditions whose value is given; a list value means `column IN (...)` (of "column" or
    "column = ?")."""
    clauses, args = [], []
    for clause, value in conditions:
        if value is None:
            continue
        if isinstance(value, list):
            clauses.append(f"{clause.removesuffix(' = ?')} IN ({','.join('?' * len(value))})")
            args += value
        else:
            clauses.append(clause)
            args.append(value)
    return ("WHERE " + " AND ".join(clauses)) if clauses else "", args


_MOVE_ATTEMPT = "UPDATE attempts SET status=?, ended_at=?, error=? WHERE attempt_id=?"
_MOVE_ROLLOUT = "UPDATE rollouts SET status=?, reward=?, error=?, ended_at=? WHERE rollout_id=?"


def _ending(attempt: Attempt, status: str, now: float, reward: float | None, error: str | None,
            row: tuple) -> tuple[tuple, tuple, tuple]:
    """What ending the running `attempt` as `status` does to it and to its rollout (`row`), checked, nothing
    written: the attempt's move and the rollout's (parameters of _MOVE_ATTEMPT and _MOVE_ROLLOUT) and the rollout's
    row after them. Whether the rollout ends or goes back to the queue is decided here."""
    check_move("attempt", attempt.attempt_id, attempt.status, status)
    config = attempt_policy(row[2])
    if status == "timeout" and reward is None and config.timeout_policy == "policy":
        reward = 0.0  # the policy ran past the deadline (a store-side expiry, or a worker that did not score it)
    if status == "succeeded":
        new = "succeeded"
    elif reward is None and status in config.retry_on and row[5] < config.max_attempts:
        new = "requeued"  # a platform failure; one the policy caused was scored, and stands
    else:
        new = "failed"
    check_move("rollout", row[0], row[3], new)
    ended = None if new == "requeued" else now
    return ((status, now, error, attempt.attempt_id), (new, reward, error, ended, row[0]),
            (*row[:3], new, row[4], row[5], reward, error, row[8], ended, row[10]))


