"""LightningRL: an agent's trace becomes single-turn RL data.

Only the policy's calls become transitions (an agent may call other models too, and a multi-agent workflow may train
one of its agents: algorithm/select.py picks them by model and agent name), ordered by time, and only
as the policy server recorded them (origin "server"): spans sent through the store's API cannot make training data;
and only the calls the agent got an answer to (`answered`): an errored or aborted one stays in the trace, untrained;
and no call a teacher answered (serving/teacher.py), unless the batch is imitation (`imitation`: the sft objective);
of a call's n choices, the one the agent went on from where a later call tells (`_gone_on_from`).
Each transition carries the episode's final reward — the task's reward function's verdict, or, where a task opts in
(`task.agent_rewards`), the last reward its agent emitted — and, as its step reward, the intermediate rewards
recorded after that call and before the next: automatic ones (AIR, algorithm/air.py, stored by the platform) and,
where the task opts in, the agent's earlier ones; algorithm/advantages.py assigns the credit. A rollout whose final
reward or any of the platform's intermediate ones is not a finite number is left out, like one the platform failed.
"""

from __future__ import annotations

import math

import numpy as np

from lightning_ray.algorithm.select import Selection
from lightning_ray.tracing import semconv
from lightning_ray.types import Rollout, Span, Transition


def transitions_from_spans(rollout: Rollout, spans: list[Span], policy_model: str,
                           agent_rewards: bool = False, select: Selection | None = None) -> list[Transition]:
    """A rollout without a reward failed for the platform's reasons (a timeout, a lost worker, a server error),
    not the policy's: it gives no transitions, rather than teaching the policy that it scored 0; so does one whose
    reward is not a finite number. `select`: which calls are the policy's (default: those to `policy_model`);
    steps are numbered among the selected calls, of those the agent got an answer to (`answered`)."""
    return _transitions(rollout, spans, policy_model, agent_rewards, select)[0] or []


def _transitions(rollout: Rollout, spans: list[Span], policy_model: str, agent_rewards: bool,
                 select: Selection | None, imitation: bool = False) -> tuple[list[Transition] | None, int]:
    """transitions_from_spans' transitions, None when the platform failed the rollout; and the selected calls left
    out as never answered. `imitation`: a teacher's calls may be trained on (with the sft objective only)."""
    spans = [s for s in spans if s.attempt_id == rollout.attempt_id]  # the attempt that ended the rollout
    rewards = sorted((s for s in spans if s.name == semconv.REWARD), key=lambda s: s.start_time)
    intermediate = [s for s in rewards if s.origin == "server"]  # AIR's: the platform's own, each must be a number
    reward, emitted = rollout.reward, [s for s in rewards if s.origin == "client" and _number(s)
                                       and not s.attributes.get(semconv.REWARD_TASK)]
    if agent_rewards and emitted:
        reward, intermediate = emitted[-1].attributes[semconv.REWARD_VALUE], intermediate + emitted[:-1]
    # a NaN or infinite reward would poison its whole group's baseline: the rollout is left out, as a failed one
    if reward is None or not _finite(reward) or not all(map(_number, intermediate)):
        return None, 0
    select = select or Selection.of(policy_model)
    selected = [c for c in select.calls(recorded_calls(spans), spans)
                if (imitation or semconv.TEACHER not in c.attributes) and not _after_the_end(c, rollout)]
    calls = _gone_on_from(sorted(filter(answered, selected), key=lambda s: s.start_time))
    step_rewards, step_of = [0.0] * len(calls), {c.span_id: i for i, c in enumerate(calls)}
    for r in intermediate if calls else []:
        step = step_of.get(r.attributes.get(semconv.REWARD_CALL))  # to the call it names, else to the last call
        if step is None:  # that started before it (one before any: the first)
            step = max(sum(c.start_time <= r.start_time for c in calls) - 1, 0)
        step_rewards[step] += r.attributes[semconv.REWARD_VALUE]
    return [
        Transition(
            rollout_id=rollout.rollout_id,
            group_id=rollout.task.group_id or rollout.task.task_id,
            span_id=s.span_id,
            prompt_ids=s.attributes[semconv.PROMPT_TOKEN_IDS],
            response_ids=s.attributes[semconv.COMPLETION_TOKEN_IDS],
            logprobs=s.attributes[semconv.LOGPROBS],
            reward=reward,
            step=i,
            step_reward=step_rewards[i],
            finish_reason=s.attributes[semconv.FINISH_REASONS][0],
            policy_version=s.attributes[semconv.POLICY_VERSION],
            temperature=_temperature(s),
            top_p=s.attributes.get(semconv.SAMPLING, {}).get("top_p", 1.0),
            adapter=s.attributes.get(semconv.ADAPTER),
            **_constrained(s),
        )
        for i, s in enumerate(calls)
    ], len(selected) - len(calls)


def answered(call: Span) -> bool:
    """Whether the agent got this call's answer: not one that errored or was aborted (a client that disconnected,
    an engine error, a drain timeout), nor one without a finish reason. The others hold tokens the agent never saw
    (a client that retries sends the call again, and the retry is the one it saw): recorded, never trained."""
    finish = (call.attributes.get(semconv.FINISH_REASONS) or [None])[0]
    return call.status != "error" and not call.attributes.get(semconv.CALL_ERROR) and bool(finish)


def spans_read(select: Selection, air: bool) -> list[str] | None:
    """The names of the spans the trainer reads from the store to adapt (and, with `air`, to judge) a batch: the calls
    and the rewards, not the agents', tools' and rollouts' spans (over half of a multi-agent trace's spans, a third of
    the read's time); None (all) when calls are selected by agent (a call's agent is found among its ancestors, which
    may be any span) or AIR judges the trace (tool spans, which are named by their framework)."""
    return None if select.agents is not None or air else [semconv.LLM_CALL, semconv.REWARD]


def recorded_calls(spans: list[Span]) -> list[Span]:
    """The LLM calls the policy server recorded itself: the only spans training data is made of."""
    return [s for s in spans if s.name == semconv.LLM_CALL and s.origin == "server"]


def adapt(rollouts: list[Rollout], spans: list[Span], policy_model: str, level: str = "transition",
          agent_rewards: bool = False, select: Selection | None = None,
          imitation: bool = False) -> tuple[list[Transition], dict]:
    """Every rollout's spans to transitions (or, at the trajectory level, to one sequence per episode where the
    tokens allow). Counts (they add up over batches): policy calls, those cut off at max_tokens, those never
    answered (left out), the joins between a rollout's consecutive calls, with those where a call's prompt did not
    extend the previous context, the rollouts left out as the platform's failures (no reward, or not a finite
    one), the calls a weight update landed in, and the policy's tokens in all (before the trainer leaves any out).
    """
    by_rollout: dict[str, list[Span]] = {}
    for s in spans:
        by_rollout.setdefault(s.rollout_id, []).append(s)
    # calls a weight update landed in (serve.drain=keep): their tokens are two versions' (the learner weighs each
    # token against its own sampler's logprob); the transition's version is the oldest, for staleness
    resumed_ids = {s.span_id for s in spans if len(s.attributes.get(semconv.POLICY_VERSION_SPANS) or ()) > 1}
    out, calls, truncated, unanswered, joins, breaks, failed, resumed = [], 0, 0, 0, 0, 0, 0, 0
    for r in rollouts:
        transitions, left_out = _transitions(r, by_rollout.get(r.rollout_id, []), policy_model, agent_rewards, select,
                                             imitation)
        if transitions is None:
            failed += 1
            continue
        calls += len(transitions)
        truncated += sum(t.finish_reason == "length" for t in transitions)
        resumed += sum(t.span_id in resumed_ids for t in transitions)
        unanswered += left_out
        joins += max(len(transitions) - 1, 0)
        if level == "trajectory":
            transitions, broken = merge_calls(transitions)
            breaks += broken
        out += transitions
    return out, {"policy_calls": calls, "action_tokens": sum(t.action_tokens for t in out),
                 "truncated_calls": truncated, "unanswered_calls": unanswered,
                 "call_joins": joins, "prefix_breaks": breaks, "infra_failed_rollouts": failed,
                 "calls_across_updates": resumed}


def merge_calls(transitions: list[Transition]) -> tuple[list[Transition], int]:
    """Trajectory level: consecutive calls of one rollout become one sequence when each call's prompt extends the
    previous call's prompt + response token for token; what lies between (tool results, user turns) stays in the
    sequence as context, masked out of the loss. One forward pass then scores the whole episode instead of one per
    call, each re-reading the episode so far. A call whose prompt does not extend the previous one (the agent, or
    the chat template, re-rendered the conversation into other tokens: re-tokenization drift) starts a new
    sequence. A call cut off at max_tokens stays a sequence of its own, so that algorithm.overlong_filter leaves out
    that call alone, as at the transition level. Returns the sequences and how many joins drift broke. Input: a
    rollout's calls in time order."""
    runs: list[list[Transition]] = []  # the calls merged into each sequence
    breaks = 0
    for t in transitions:
        last = runs[-1][-1] if runs and runs[-1][-1].rollout_id == t.rollout_id else None
        if last is not None and "length" not in (last.finish_reason, t.finish_reason) and \
                (last.temperature, last.top_p, last.policy_version, last.adapter, last.constrained) \
                == (t.temperature, t.top_p, t.policy_version, t.adapter, t.constrained):
            if _extends(t, last):
                runs[-1].append(t)
                continue
            breaks += 1
        runs.append([t])
    return [_merged(run) for run in runs], breaks


def _extends(t: Transition, last: Transition) -> bool:
    """Whether `t`'s prompt starts with `last`'s prompt + response (the sequence so far, if `last` extended those
    before it)."""
    p, r = len(last.prompt_ids), len(last.response_ids)
    return (len(t.prompt_ids) >= p + r and np.array_equal(t.prompt_ids[:p], last.prompt_ids)
            and np.array_equal(t.prompt_ids[p:p + r], last.response_ids))


def _merged(run: list[Transition]) -> Transition:
    """One sequence from calls that each extend the one before: the first call's prompt, then every response with
    the tokens between them (logprob 0, masked out of the loss). Concatenated once, not call by call."""
    first = run[0]
    if len(run) == 1:
        return first
    ids, logprobs, mask = [first.response_ids], [first.logprobs], [first.action_mask]
    for last, t in zip(run, run[1:]):
        between = t.prompt_ids[len(last.prompt_ids) + len(last.response_ids):]
        ids += [between, t.response_ids]
        logprobs += [np.zeros(len(between)), t.logprobs]
        mask += [np.zeros(len(between), np.int8), t.action_mask]
    return first.model_copy(update={"response_ids": np.concatenate(ids), "logprobs": np.concatenate(logprobs),
                                    "loss_mask": np.concatenate(mask), "finish_reason": run[-1].finish_reason,
                                    "call_tokens": [t.action_tokens for t in run]})


def scored_faithfully(span: Span) -> bool:
    """Whether the learner can score a call's tokens under the distribution they were sampled from: it scores the
    softmax at the call's temperature, so greedy, top-p-truncated and grammar-constrained calls are approximations
    (scored at temperature 1, or without the truncation / the grammar's mask). The trainer reports how many."""
    sampling = span.attributes.get(semconv.SAMPLING, {})
    return (sampling.get("temperature", 1.0) > 0 and sampling.get("top_p", 1.0) >= 1.0
            and not sampling.get("constrained"))


def _constrained(span: Span) -> dict:
    """A grammar-constrained call's Transition fields: the tokens it forced (the only one allowed: logprob 0 under
    the mask) are no action of the policy's."""
    if not span.attributes.get(semconv.SAMPLING, {}).get("constrained"):
        return {}
    return {"constrained": True, "loss_mask": (np.asarray(span.attributes[semconv.LOGPROBS]) != 0).astype(np.int8)}


def _temperature(span: Span) -> float:
    t = span.attributes.get(semconv.SAMPLING, {}).get("temperature", 1.0)
    return t if t > 0 else 1.0  # greedy: no temperature to score at


def _gone_on_from(calls: list[Span]) -> list[Span]:
    """A request with n > 1 is recorded as a span per choice (the same start and prompt). Where a later call's prompt
    goes on from one choice (extends its prompt + response), that is the choice the agent used: its siblings are left
    out, not trained with the episode's reward. Where none is gone on from (the episode's last call; an agent that
    votes), all stay."""
    def prompt(c: Span):
        return c.attributes[semconv.PROMPT_TOKEN_IDS]

    def continued(call: Span) -> bool:
        p, response = len(prompt(call)), call.attributes[semconv.COMPLETION_TOKEN_IDS]
        return any(c.start_time > call.start_time and len(prompt(c)) >= p + len(response)
                   and np.array_equal(prompt(c)[:p], prompt(call))
                   and np.array_equal(prompt(c)[p:p + len(response)], response) for c in calls)

    def sibling_used(call: Span) -> bool:
        return any(c is not call and c.start_time == call.start_time and np.array_equal(prompt(c), prompt(call))
                   and continued(c) for c in calls)

    return [c for c in calls if not sibling_used(c) or continued(c)]


# A call the attempt's agent cannot have made: one that started after the rollout ended (a command agent's process
# that left its process group, still holding the attempt's key), with slack for the clocks of two machines.
CLOCK_SLACK_S = 1.0


def _after_the_end(call: Span, rollout: Rollout) -> bool:
    return rollout.ended_at is not None and call.start_time > rollout.ended_at + CLOCK_SLACK_S


def _number(span: Span) -> bool:
    """A reward span whose value is a finite number; an agent's malformed one is passed over, not a crash (the
    platform's own, AIR's, must be one)."""
    return _finite(span.attributes.get(semconv.REWARD_VALUE))


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
