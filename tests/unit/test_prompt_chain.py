"""A multi-turn episode's prompt ids are stored once (store/prompt_chain.py): each call keeps only what its prompt
adds to an earlier call's prompt and completion, the file grows linearly in an episode's turns, and every reader
still gets each prompt whole, whatever it asked for and whatever came in between."""

from __future__ import annotations

import random
import sqlite3

import numpy as np

from lightning_ray.store.rows import span_row
from lightning_ray.store.sqlite import SQLiteBackend
from lightning_ray.tracing import semconv
from lightning_ray.types import Rollout, Span, Task


def call(rollout: str, prompt: list[int], completion: list[int], start: float, attempt: str = "a") -> Span:
    return Span(rollout_id=rollout, attempt_id=attempt, name=semconv.LLM_CALL, start_time=start, end_time=start + 0.5,
                attributes={semconv.PROMPT_TOKEN_IDS: prompt, semconv.COMPLETION_TOKEN_IDS: completion,
                            semconv.LOGPROBS: [-0.5] * len(completion)})


def episode(rollout: str, turns: int, rng: random.Random, start: float = 0.0) -> list[Span]:
    """An agent's conversation: each call is sent the last call's prompt and completion, then a tool's result."""
    prompt, spans = [rng.randrange(1000) for _ in range(200)], []
    for turn in range(turns):
        completion = [rng.randrange(1000) for _ in range(20)]
        spans.append(call(rollout, prompt, completion, start + turn))
        prompt = prompt + completion + [rng.randrange(1000) for _ in range(30)]
    return spans


def store_with(tmp_path, n: int = 1) -> SQLiteBackend:
    store = SQLiteBackend(tmp_path / "traces.sqlite")
    store.enqueue([Rollout(rollout_id=f"r{i}", task=Task(task_id=f"t{i}", input={})) for i in range(n)])
    return store


def prompts(spans: list[Span]) -> list[list[int]]:
    return [np.asarray(s.attributes[semconv.PROMPT_TOKEN_IDS]).tolist() for s in spans]


def stored_bytes(tmp_path) -> int:
    return sqlite3.connect(tmp_path / "traces-spans.sqlite").execute("SELECT SUM(LENGTH(arrays)) FROM spans").fetchone()[0]


def test_an_episodes_prompts_are_stored_once_and_read_back_whole(tmp_path):
    store = store_with(tmp_path)
    spans = episode("r0", 40, random.Random(0))
    for s in spans:  # one call at a time, as the policy server records them
        store.add_span_rows([span_row(s)])
    sent = sum(4 * len(s.attributes[semconv.PROMPT_TOKEN_IDS]) for s in spans)  # 188 KB, quadratic in turns
    # what the episode added (the prompts' tails, completions, logprobs) and ~150 bytes of keys and headers a call
    added = 4 * (200 + 39 * 30) + 40 * (4 * 20 + 8 * 20 + 150)
    assert stored_bytes(tmp_path) < added < sent / 8
    assert prompts(store.query_spans(["r0"])) == prompts(spans)
    assert prompts(SQLiteBackend(tmp_path / "traces.sqlite").query_spans(["r0"])) == prompts(spans)  # reopened


def test_a_read_that_leaves_out_the_earlier_calls_still_gets_whole_prompts(tmp_path):
    store = store_with(tmp_path)
    spans = episode("r0", 6, random.Random(1))
    store.add_span_rows([span_row(s) for s in spans])  # one batch: each call's base is in the same insert
    assert prompts(store.query_spans(since=4)) == prompts(spans[4:])
    assert prompts(store.query_spans(["r0"], limit=2)) == prompts(spans[:2])
    assert prompts(store.query_spans(attempt_id="a", since=5)) == prompts(spans[5:])


def test_prompts_that_extend_no_earlier_call_are_stored_whole(tmp_path):
    """A retried attempt starts over; an agent that rewrites its history (a summary, a trimmed tool result) extends
    nothing; two choices of one call (n=2), and the next turn extends the first; interleaved rollouts; spans a
    restarted store never saw. Each reads back exactly."""
    store = store_with(tmp_path, n=2)
    rng = random.Random(2)
    first = episode("r0", 3, rng)
    retry = [call("r0", s.attributes[semconv.PROMPT_TOKEN_IDS], [7, 8, 9], 10 + i, attempt="b")
             for i, s in enumerate(first)]
    p = first[-1].attributes[semconv.PROMPT_TOKEN_IDS]
    rewritten = call("r0", p[:100] + p[150:], [1], 20)
    choices = [call("r1", [5] * 50, [6] * 10, 30), call("r1", [5] * 50, [4] * 10, 30.1)]
    after_first_choice = call("r1", [5] * 50 + [6] * 10 + [3], [2], 31)
    other = episode("r1", 3, rng, start=40)
    mixed = [s for pair in zip(episode("r0", 3, rng, start=50), other) for s in pair]
    everything = [*first, *retry, rewritten, *choices, after_first_choice, *mixed]
    for s in everything:
        store.add_span_rows([span_row(s)])
    restarted = SQLiteBackend(tmp_path / "traces.sqlite")
    later = call("r0", everything[-2].attributes[semconv.PROMPT_TOKEN_IDS] + [1, 2], [3], 60)
    restarted.add_span_rows([span_row(later)])
    everything.append(later)
    by_id = {s.span_id: s for s in everything}
    back = restarted.query_spans()
    assert len(back) == len(everything)
    assert prompts(back) == prompts([by_id[s.span_id] for s in back])
    assert back == sorted(back, key=lambda s: s.start_time)
    assert [s.attributes[semconv.LOGPROBS].tolist() for s in back] == [
        by_id[s.span_id].attributes[semconv.LOGPROBS] for s in back]


def test_deleted_spans_are_never_named_as_a_prompts_base(tmp_path):
    """Retention deletes a rollout's spans; a call of a rollout still running afterwards is stored whole, not as the
    tail of a call that is gone."""
    store = store_with(tmp_path, n=1)
    spans = episode("r0", 3, random.Random(3))
    store.add_span_rows([span_row(s) for s in spans[:2]])
    assert store.delete_spans(before=float("inf")) == 2
    store.add_span_rows([span_row(spans[2])])
    assert prompts(store.query_spans(["r0"])) == prompts(spans[2:])
