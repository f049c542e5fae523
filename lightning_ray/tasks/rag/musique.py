"""MuSiQue's released layout (musique_ans_v1.0_*.jsonl, musique_full_v1.0_*.jsonl): one JSON object a line with
`id`, `question`, `answer`, `answer_aliases`, `answerable` and `paragraphs`, a list of
{idx, title, paragraph_text, is_supporting} (the question's supporting paragraphs among distractors; the
"distractor setting" retrieves from these). The data is not shipped here: point task.generator.path at a file.
"""

from __future__ import annotations

import json
from pathlib import Path


class MusiqueFormatError(ValueError):
    """A line that is not a MuSiQue record; the message names the file and line."""


def read_musique(path: str | Path) -> list[dict]:
    """The answerable questions of a MuSiQue file, in file order, as task inputs: question, answers (the answer,
    then its aliases), the paragraphs ordered by idx as {title, text}, the positions of the supporting ones, and
    the record's id. Unanswerable questions (MuSiQue-Full's contrast set) are left out: the reward scores answers."""
    out = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = _record(json.loads(line))
            except (ValueError, KeyError, TypeError) as e:
                raise MusiqueFormatError(f"{path}:{number}: not a MuSiQue record ({type(e).__name__}: {e})") from None
            if record is not None:
                out.append(record)
    return out


def _record(r: dict) -> dict | None:
    if not r.get("answerable", True):
        return None
    paragraphs = sorted(r["paragraphs"], key=lambda p: int(p["idx"]))
    answers = [str(r["answer"]), *(str(a) for a in r.get("answer_aliases") or [])]
    if not str(r["question"]).strip() or not answers[0].strip():
        raise ValueError("an empty question or answer")
    return {"question": str(r["question"]), "answers": answers,
            "paragraphs": [{"title": str(p["title"]), "text": str(p["paragraph_text"])} for p in paragraphs],
            "supporting": [i for i, p in enumerate(paragraphs) if p["is_supporting"]], "id": str(r["id"])}
