"""Automatic intermediate rewards (AIR): runtime signals of an agent's run turned into rewards, per task's rules.

A tool call's status (ok / error / timeout, from its `execute_tool` span), a tool call the policy wrote but nobody
could parse (an unparsed `<tool_call>` block left in its answer), and a format check on each policy answer (a
regex). Each signal that a rule gives a nonzero value becomes a reward span, stored with the trace (visible beside
the call it judges) and credited (lightningrl) to the policy call it judges: an answer's reward to that answer's call;
a tool's to the call that asked for the tool, named by the tool call's id where the agent's tool span reports it
(gen_ai.tool.call.id: the server's ids name the answer's span, serving/tools.tool_call_id), else to the last call
that started before the tool did. Time alone compares the agent's clock with the server's: under clock skew
between their machines it can credit the wrong call.
"""

from __future__ import annotations

import re

from lightning_ray.algorithm.lightningrl import answered, recorded_calls
from lightning_ray.config import AIRConfig
from lightning_ray.serving.tools import TOOL_CALL_FORMATS, asking_span_id, parse_tool_calls
from lightning_ray.tracing import semconv
from lightning_ray.types import Span

RULE = "lightning_ray.air.rule"  # on an AIR reward span: which rule gave it


def air_spans(spans: list[Span], rules: AIRConfig, policy_calls) -> list[Span]:
    """The reward spans the rules give for one batch of spans (any rollouts). `policy_calls` picks the policy's
    calls out of spans (algorithm/lightningrl.py)."""
    calls = policy_calls(spans)
    policy = {(c.rollout_id, c.span_id) for c in calls}
    recorded = {(c.rollout_id, c.span_id) for c in recorded_calls(spans)}
    out = []
    for s in spans:
        if s.attributes.get(semconv.OPERATION) == semconv.EXECUTE_TOOL:
            asked = (s.rollout_id, asking_span_id(str(s.attributes.get(semconv.TOOL_CALL_ID, ""))))
            if asked not in recorded:  # the tool call's id names no call: credited by time
                out += _reward(s, _tool_rule(s), rules)
            elif asked in policy:  # (a tool another model's call asked for judges no policy call)
                out += _reward(s, _tool_rule(s), rules, call=asked[1])
    for call in filter(answered, calls):  # an answer the agent never got is not judged
        text = call.attributes.get(semconv.RESPONSE_TEXT) or ""
        content, _ = parse_tool_calls(text)
        # a well-formed block would have been parsed out of the content
        if TOOL_CALL_FORMATS["hermes"].start in (content or ""):
            out += _reward(call, "malformed_tool_call", rules, call=call.span_id)
        if rules.format_pattern is not None:
            rule = "format_ok" if re.search(rules.format_pattern, text) else "format_mismatch"
            out += _reward(call, rule, rules, call=call.span_id)
    return out


def _tool_rule(span: Span) -> str:
    if span.status != "error":
        return "tool_ok"
    reason = f"{span.attributes.get(semconv.ERROR_TYPE, '')} {span.status_message or ''}".lower()
    return "tool_timeout" if "timeout" in reason or "timed out" in reason else "tool_error"


def _reward(signal: Span, rule: str, rules: AIRConfig, call: str | None = None) -> list[Span]:
    """`call`: the span id of the policy call the reward is for, where known (else credited by time)."""
    value = getattr(rules, rule)
    if not value:
        return []
    credit = {semconv.REWARD_CALL: call} if call else {}
    return [Span(trace_id=signal.trace_id, parent_id=signal.span_id, rollout_id=signal.rollout_id,
                 attempt_id=signal.attempt_id, name=semconv.REWARD, start_time=signal.start_time,
                 end_time=signal.start_time, status="ok",
                 attributes={semconv.REWARD_VALUE: value, RULE: rule, **credit},
                 origin="server")]  # the platform's own verdict, as the store marks it when the trainer stores it
