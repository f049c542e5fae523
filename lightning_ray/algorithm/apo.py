"""Automatic prompt optimization (APO): the policy rewrites its own agent's system prompt from the traces of its own
failures, and a rewrite is kept only when it measures better.

Per round, on the real platform (the services training uses):
1. the incumbent prompt's validation rollouts (greedy, traced in the store) are ranked by reward, and the worst
   ones' policy replies are read back from their recorded LLM spans;
2. the policy endpoint, through the `openai` client, critiques the prompt given those failures ...
3. ... and rewrites it given the critique: `apo.beam` candidates in one request (n=beam);
4. each candidate, sanitized, is measured on the validation split by rollouts of the unmodified agent, which gets it
   as task.input["system_prompt"] (tasks/__init__.py);
5. the best candidate replaces the incumbent only if it scored higher: a prompt that measured worse or the same is
   never adopted.
At the end the initial and the best prompt are measured on the task's held-out split, which selected nothing.

The critic's and the editor's requests carry a W3C traceparent naming an `apo.critique` / `apo.edit` span that the
optimizer stores itself, so the server's LLM spans of those calls nest under them: the store holds the whole search,
which calls wrote which candidate and (by group id `apo-<round>-<candidate>`) each candidate's rollouts.
"""

from __future__ import annotations

import json
import random
import re
import secrets
import time
from dataclasses import asdict, dataclass, field

import openai
from openai import OpenAI
from tqdm import tqdm

from lightning_ray.config import APOJobConfig, ConfigError
from lightning_ray.services import Services
from lightning_ray.tasks import load_splits, load_task
from lightning_ray.tracing import semconv
from lightning_ray.types import Rollout, Span, Task

CRITIQUE_SPAN, EDIT_SPAN = "apo.critique", "apo.edit"

CRITIC_SYSTEM = "You review the system prompt given to an AI assistant and explain why the assistant failed."
CRITIC_ASK = ("The assistant was given this system prompt:\n\"\"\"\n{prompt}\n\"\"\"\n\n"
              "It got these problems wrong:\n\n{failures}\n\nIn a few sentences, say what the system prompt should "
              "tell the assistant so that it gets problems like these right.")
EDITOR_SYSTEM = "You write system prompts for an AI assistant."
EDITOR_ASK = ("Current system prompt:\n\"\"\"\n{prompt}\n\"\"\"\n\nFeedback on it:\n{critique}\n\nWrite an improved "
              "system prompt that follows the feedback and keeps what works. Reply with the new system prompt only.")

_SPECIAL = re.compile(r"<\|[^|>]*\|>")  # chat-format tokens (<|im_end|>) would be parsed back as chat structure
_FENCE = re.compile(r"^```[\w-]*\n(.*?)\n?```$", re.S)
_LABEL = re.compile(  # "Here is the improved system prompt:" and the like
    r"^(?:here is |here's )?(?:the |an |my )?(?:(?:new|improved|revised|updated) )*system prompt\s*:\s*", re.I)


@dataclass
class Candidate:
    prompt: str
    round: int  # 0: the initial prompt
    raw: str | None = None  # the editor's text before sanitizing
    rejected: str | None = None  # why it was not measured: empty, unchanged, duplicate
    score: float | None = None  # mean reward on the validation split (greedy)
    accuracy: float | None = None  # share of validation tasks solved (reward 1)
    rollout_ids: list[str] = field(default_factory=list)


def sanitize(raw: str, max_chars: int) -> str:
    """The editor's reply as a prompt: chat tokens, a code fence, a "New system prompt:" label, wrapping quotes and
    control characters removed, cut to max_chars at a word boundary. "" (rejected) when no letter or digit is left:
    a 135M editor, let alone a random test model, often writes nothing usable."""
    text = "".join(c for c in _SPECIAL.sub("", raw) if c.isprintable() or c in "\n\t").strip()
    if m := _FENCE.match(text):
        text = m[1].strip()
    text = _LABEL.sub("", text).strip()
    for quote in ('"""', '"', "'", "`"):
        if len(text) > 2 * len(quote) and text.startswith(quote) and text.endswith(quote):
            text = text[len(quote):-len(quote)].strip()
            break
    if len(text) > max_chars:
        head = text[:max_chars]
        space = max(head.rfind(" "), head.rfind("\n"))
        text = (head[:space] if not text[max_chars].isspace() and space > 0 else head).rstrip()
    return text if any(c.isalnum() for c in text) else ""


def rejection(prompt: str, incumbent: str, seen: set[str]) -> str | None:
    """Why a sanitized candidate is not worth measuring, or None. Measurements are greedy, so a prompt already
    measured would score the same again."""
    if not prompt:
        return "empty"
    if prompt == incumbent:
        return "unchanged"
    if prompt in seen:
        return "duplicate"
    return None


def select(incumbent: Candidate, candidates: list[Candidate]) -> Candidate:
    """The best measured candidate if it scored strictly higher than the incumbent, else the incumbent. Ties among
    candidates go to the first."""
    best = max((c for c in candidates if c.score is not None), key=lambda c: c.score, default=None)
    return best if best is not None and best.score > incumbent.score else incumbent


class PromptOptimizer:
    def __init__(self, services: Services, cfg: APOJobConfig):
        self.services, self.cfg, self.apo = services, cfg, cfg.apo
        self.client = OpenAI(base_url=f"{services.server_url}/v1", api_key=cfg.serve.api_key or "EMPTY",
                             max_retries=0)
        self.trace_id = secrets.token_hex(16)  # one trace for the whole search

    def measure(self, prompt: str, tasks: list[Task], group: str, desc: str) -> tuple[dict, list[Rollout]]:
        """Greedy rollouts of the unmodified agent with `prompt` as its system prompt, traced in the store."""
        runs = [t.model_copy(update={"input": {**t.input, "system_prompt": prompt}, "sampling": {"temperature": 0.0},
                                     "group_id": group}) for t in tasks]
        rollouts = self.services.run_rollouts(runs, desc)
        return {"reward_mean": sum(r.reward or 0.0 for r in rollouts) / len(rollouts),
                "accuracy": sum(r.reward is not None and r.reward >= 1.0 for r in rollouts) / len(rollouts),
                "failed_rollouts": sum(r.reward is None for r in rollouts)}, rollouts

    def measure_candidate(self, c: Candidate, tasks: list[Task], group: str, desc: str) -> None:
        result, rollouts = self.measure(c.prompt, tasks, group, desc)
        c.score, c.accuracy, c.rollout_ids = result["reward_mean"], result["accuracy"], [r.rollout_id for r in rollouts]

    def failures(self, c: Candidate, round_no: int) -> list[dict]:
        """The candidate's worst-scored validation rollouts (reward below 1; the platform's failures, which have no
        reward, say nothing about the prompt) with the policy's replies from their recorded LLM spans, in order.
        Ties (most failures score 0) are broken at random per round: an incumbent that stays shows the critic other
        failures next round."""
        failed = [r for r in self.services.store.get_rollouts(c.rollout_ids) if r.reward is not None and r.reward < 1]
        random.Random(self.cfg.seed * 1000 + round_no).shuffle(failed)
        worst = sorted(failed, key=lambda r: r.reward)[:self.apo.failures]
        spans = self.services.store.query_spans([r.rollout_id for r in worst], name=semconv.LLM_CALL)
        return [{"rollout_id": r.rollout_id, "question": r.task.input.get("question", json.dumps(r.task.input)),
                 "answer": r.task.reward_input.get("answer"), "reward": r.reward,
                 "replies": [s.attributes.get(semconv.RESPONSE_TEXT, "") for s in spans
                             if s.rollout_id == r.rollout_id and s.attempt_id == r.attempt_id]} for r in worst]

    def critique(self, prompt: str, failures: list[dict], round_no: int) -> str:
        """One critique. A prompt past the model's context (long questions, long replies) is asked again with half the
        failures."""
        while True:
            shown = "\n\n".join(self._failure(f) for f in failures)
            messages = [{"role": "system", "content": CRITIC_SYSTEM},
                        {"role": "user", "content": CRITIC_ASK.format(prompt=prompt, failures=shown)}]
            try:
                return self._ask(CRITIQUE_SPAN, messages, 1, self.apo.critique_max_tokens, round_no,
                                 {"apo.round": round_no, "apo.prompt": prompt,
                                  "apo.failures": [f["rollout_id"] for f in failures]})[0].strip()
            except openai.BadRequestError:
                if len(failures) <= 1:
                    raise
                failures = failures[:len(failures) // 2]

    def rewrite(self, prompt: str, critique: str, round_no: int) -> list[str]:
        """`apo.beam` rewrites of the prompt given the critique, as the editor wrote them (unsanitized)."""
        messages = [{"role": "system", "content": EDITOR_SYSTEM},
                    {"role": "user", "content": EDITOR_ASK.format(prompt=prompt, critique=critique)}]
        return self._ask(EDIT_SPAN, messages, self.apo.beam, self.apo.edit_max_tokens, round_no,
                         {"apo.round": round_no, "apo.prompt": prompt, "apo.critique": critique})

    def _failure(self, f: dict) -> str:
        replies = "\n".join(f"Assistant: {reply.strip()[:self.apo.reply_chars]}" for reply in f["replies"])
        answer = f"\nCorrect answer: {f['answer']}" if f["answer"] is not None else ""
        return f"Problem: {f['question']}\n{replies or 'Assistant: (no reply)'}{answer}\nScore: {f['reward']:.2f}"

    def _ask(self, name: str, messages: list[dict], n: int, max_tokens: int, round_no: int,
             attributes: dict) -> list[str]:
        """A chat request to the policy endpoint under a span of ours (stored with what it asked and got back).
        Seeded by the run's seed and the round, so a search repeats run to run (choice i samples with seed + i)."""
        span_id, start = secrets.token_hex(8), time.time()
        out = self.client.chat.completions.create(
            model=self.cfg.model.name, messages=messages, n=n, max_tokens=max_tokens, temperature=self.apo.temperature,
            seed=self.cfg.seed * 1000 + round_no * n, extra_headers={"traceparent": f"00-{self.trace_id}-{span_id}-01"})
        texts = [c.message.content or "" for c in sorted(out.choices, key=lambda c: c.index)]
        self.services.store.add_spans([Span(span_id=span_id, trace_id=self.trace_id, name=name, start_time=start,
                                            end_time=time.time(), attributes={**attributes, "apo.outputs": texts})])
        return texts


def optimize(cfg: APOJobConfig) -> dict:
    """Run the search; write apo_rounds.jsonl (every candidate, per round), apo.json and best_prompt.txt."""
    apo, run, started = cfg.apo, cfg.run_path, time.time()
    if not hasattr(load_task(cfg.task.name), "system_prompt"):
        raise ConfigError(f"task: the {cfg.task.name} task's agents have prompts of their own, none to optimize")
    train_split, held_out = load_splits(cfg.task)
    validation = train_split[:apo.val_size]  # selects; the held-out split only reports
    with Services(cfg) as services:
        opt = PromptOptimizer(services, cfg)
        progress = tqdm(total=1 + apo.rounds * apo.beam, desc="apo measurements")
        initial = Candidate(prompt=load_task(cfg.task.name).system_prompt(validation[0].input), round=0)
        opt.measure_candidate(initial, validation, "apo-0-0", "initial prompt")
        progress.update()
        tqdm.write(f"initial prompt: validation reward {initial.score:.3f} (accuracy {initial.accuracy:.3f})")
        incumbent, seen = initial, {initial.prompt}
        for r in range(1, apo.rounds + 1):
            round_start = time.time()
            record = {"round": r, "incumbent": {"prompt": incumbent.prompt, "score": incumbent.score}}
            failures = opt.failures(incumbent, r)
            candidates = []
            if failures:  # else the incumbent solved every validation task: nothing to learn from
                critique = opt.critique(incumbent.prompt, failures, r)
                for i, raw in enumerate(opt.rewrite(incumbent.prompt, critique, r)):
                    c = Candidate(prompt=sanitize(raw, apo.max_prompt_chars), round=r, raw=raw)
                    c.rejected = rejection(c.prompt, incumbent.prompt, seen)
                    if c.rejected is None:
                        seen.add(c.prompt)
                        opt.measure_candidate(c, validation, f"apo-{r}-{i + 1}", f"round {r} candidate {i + 1}")
                    candidates.append(c)
                    progress.update()
                    tqdm.write(f"round {r} candidate {i + 1}: " + (f"rejected ({c.rejected})" if c.rejected else
                               f"validation reward {c.score:.3f}") + f" | {c.prompt[:80]!r}")
                record.update(failures=failures, critique=critique)
            else:
                progress.update(apo.beam)
            kept = select(incumbent, candidates)
            record.update(candidates=[asdict(c) for c in candidates], kept={"prompt": kept.prompt, "score": kept.score},
                          improved=kept is not incumbent, seconds=round(time.time() - round_start, 1))
            with open(run / "apo_rounds.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            tqdm.write(f"round {r}: " + (f"new prompt, validation reward {incumbent.score:.3f} → {kept.score:.3f}"
                                         if kept is not incumbent else f"incumbent kept ({incumbent.score:.3f})"))
            incumbent = kept
        progress.close()
        # held-out: what the search's choice is worth on problems it never saw (one measurement if nothing changed)
        held_initial, _ = opt.measure(initial.prompt, held_out, "apo-held-out-initial", "held-out: initial prompt")
        held_best = held_initial if incumbent is initial else opt.measure(
            incumbent.prompt, held_out, "apo-held-out-best", "held-out: best prompt")[0]
    result = {
        "initial": {"prompt": initial.prompt, "validation": {"reward_mean": initial.score,
                                                             "accuracy": initial.accuracy}, "held_out": held_initial},
        "best": {"prompt": incumbent.prompt, "round": incumbent.round,
                 "validation": {"reward_mean": incumbent.score, "accuracy": incumbent.accuracy}, "held_out": held_best},
        "rounds": apo.rounds, "validation_tasks": len(validation), "held_out_tasks": len(held_out),
        "candidates_measured": len(seen) - 1, "trace_id": opt.trace_id, "seconds": round(time.time() - started, 1)}
    (run / "apo.json").write_text(json.dumps(result, indent=2) + "\n")
    (run / "best_prompt.txt").write_text(incumbent.prompt + "\n")
    return result
