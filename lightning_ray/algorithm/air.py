"""Automatic intermediate rewards (AIR): runtime signals of an agent's run turned into rewards, per task's rules.

A tool call's status (ok / error / timeout, from its `execute_tool` span), a tool call the policy wrote but nobody
could parse (an unparsed `<tool_call>` block left in its answer), and a format check on each policy answer (a
regex). Each signal that a rule gives a nonzero value becomes a reward span, stored with the trace (visible beside
the call it judges) and timed so that credit assignment (algorithm/advantages.py) credits it to the policy call it
follows: a tool's reward to the call that asked for the tool, an answer's reward to that answer's call.
"""

from __future__ import annotations

import re

from lightning_ray.algorithm.lightningrl import answered
from lightning_ray.config import AIRConfig
from lightning_ray.serving.tools import TOOL_CALL_FORMATS, parse_tool_calls
from lightning_ray.tracing import semconv
from lightning_ray.types import Span

RULE = "lightning_ray.air.rule"  # on an AIR reward span: which rule gave it


def air_spans(spans: list[Span], rules: AIRConfig, recorded_calls) -> list[Span]:
    """The reward spans the rules give for one batch of spans (any rollouts). `recorded_calls` picks the policy's
    calls out of spans (algorithm/lightningrl.py)."""
    out = []
    for s in spans:
        if s.attributes.get(semconv.OPERATION) == semconv.EXECUTE_TOOL:
            out += _reward(s, _tool_rule(s), rules)
    for call in filter(answered, recorded_calls(spans)):  # an answer the agent never got is not judged
        text = call.attributes.get(semconv.RESPONSE_TEXT) or ""
        content, _ = parse_tool_calls(text)
        # a well-formed block would have been parsed out of the content
        if TOOL_CALL_FORMATS["hermes"].start in (content or ""):
            out += _reward(call, "malformed_tool_call", rules)
        if rules.format_pattern is not None:
            out += _reward(call, "format_ok" if re.search(rules.format_pattern, text) else "format_mismatch", rules)
    return out


def _tool_rule(span: Span) -> str:
    if span.status != "error":
        return "tool_ok"
    reason = f"{span.attributes.get(semconv.ERROR_TYPE, '')} {span.status_message or ''}".lower()
    return "tool_timeout" if "timeout" in reason or "timed out" in reason else "tool_error"


def _reward(signal: Span, rule: str, rules: AIRConfig) -> list[Span]:
    value = getattr(rules, rule)
    if not value:
        return []
    return [Span(trace_id=signal.trace_id, parent_id=signal.span_id, rollout_id=signal.rollout_id,
                 attempt_id=signal.attempt_id, name=semconv.REWARD, start_time=signal.start_time,
                 end_time=signal.start_time, status="ok", attributes={semconv.REWARD_VALUE: value, RULE: rule},
                 origin="server")]  # the platform's own verdict, as the store marks it when the trainer stores it
