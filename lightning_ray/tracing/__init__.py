"""Tracing: an agent run becomes spans in the trace store.

    with trace_attempt(rollout_id, attempt_id, store_sink, backend="embedded"):   # or "otel"
        agent(...)                       # may use span(...) and the emitters

Both backends give the same Spans. The emitters write the signals RL needs (reward, tool status for AIR, messages,
objects, exceptions) and do nothing outside a traced attempt. Once `otel.setup_otel()` has run (the "otel" backend
runs it), OpenTelemetry spans an agent framework starts inside the block are stamped with the attempt's ids and
delivered with it too. Spans reach the sink in batches and at the end of the attempt. Context flows through
contextvars: a thread the agent starts itself needs `contextvars.copy_context().run(...)` to stay in the attempt
(asyncio's run_in_executor, where frameworks run sync tools, is made to carry it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

from lightning_ray.tracing import semconv
from lightning_ray.tracing.context import AttemptTrace, Sink, SpanBatch, current_attempt, live_attempts
from lightning_ray.tracing.spans import exception_type
from lightning_ray.tracing.tracer import EmbeddedTracer

__all__ = ["semconv", "trace_attempt", "span", "emit_reward", "emit_tool", "emit_message", "emit_object",
           "emit_exception", "Sink"]


@contextmanager
def trace_attempt(rollout_id: str, attempt_id: str, sink: Sink, backend: Literal["embedded", "otel"] = "embedded",
                  batch_size: int = 512) -> Iterator[None]:
    """Trace everything inside the block as this attempt's; hand the spans to `sink` (e.g. the store's add_spans),
    `batch_size` at a time and the rest when the block exits."""
    batch = SpanBatch(sink, batch_size)
    if backend == "embedded":
        tracer = EmbeddedTracer(batch, rollout_id, attempt_id)
    elif backend == "otel":
        from lightning_ray.tracing.otel import OtelTracer, setup_otel  # OpenTelemetry only where asked for

        tracer = OtelTracer(setup_otel())
    else:
        raise ValueError(f"unknown tracing backend {backend!r}: use 'embedded' or 'otel'")
    _executors_inherit_context()
    attempt = AttemptTrace(rollout_id, attempt_id, batch, tracer)
    key = (rollout_id, attempt_id)
    live_attempts[key] = attempt
    token = current_attempt.set(attempt)
    try:
        yield
    finally:
        current_attempt.reset(token)
        if live_attempts.get(key) is attempt:
            del live_attempts[key]
        batch.flush()


def _executors_inherit_context() -> None:
    """asyncio's run_in_executor runs a function in a pool thread without the caller's context (asyncio.to_thread
    copies it): a framework that runs its sync tools there (AutoGen's FunctionTool) would leave the attempt, and the
    tool's spans and emitted signals (AIR's tool status) were dropped. Patched once per process, as OpenTelemetry's
    threading instrumentation patches thread pools for its own context."""
    run_in_executor = asyncio.BaseEventLoop.run_in_executor
    if getattr(run_in_executor, "copies_context", False):
        return

    def in_callers_context(self, executor, func, *args):
        if executor is not None and not isinstance(executor, concurrent.futures.ThreadPoolExecutor):
            return run_in_executor(self, executor, func, *args)  # another process: a context does not pickle
        return run_in_executor(self, executor, contextvars.copy_context().run, func, *args)

    in_callers_context.copies_context = True
    asyncio.BaseEventLoop.run_in_executor = in_callers_context


class _NoSpan:
    """What span(...) gives outside a traced attempt: accepts everything, records nothing."""

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:  # set_attribute, add_event, record_exception, set_status, end, ...
        return lambda *args, **kwargs: None


_NO_SPAN = _NoSpan()


def span(name: str, attributes: dict[str, Any] | None = None):
    """A context manager tracing its block as a child of the current span. It gives a span with set_attribute(s),
    add_event, record_exception and set_status (OpenTelemetry's names); an exception leaving the block marks it
    error. Outside a traced attempt it records nothing."""
    attempt = current_attempt.get()
    return _NO_SPAN if attempt is None else attempt.tracer.span(name, attributes)


def emit_reward(value: float | dict[str, float], primary: str | None = None) -> None:
    """A `reward` span. A dict is a multi-dimensional reward: each dimension as f"lightning_ray.reward.{name}", and
    `lightning_ray.reward` (what LightningRL optimises) is the `primary` dimension, by default the first. NaN or
    infinity raises ValueError."""
    attempt = current_attempt.get()
    if attempt is None:
        return
    if isinstance(value, dict):
        if not value:
            raise ValueError("emit_reward: a reward dict needs at least one dimension")
        attributes = {f"{semconv.REWARD_VALUE}.{k}": float(v) for k, v in value.items()}
        attributes[semconv.REWARD_VALUE] = float(value[primary if primary is not None else next(iter(value))])
    else:
        attributes = {semconv.REWARD_VALUE: float(value)}
    if not all(map(math.isfinite, attributes.values())):  # the store refuses it: said here, not at the attempt's end
        raise ValueError(f"emit_reward: rewards must be finite numbers, got {value!r}")
    attempt.tracer.record(semconv.REWARD, attributes)


def emit_tool(name: str, arguments: Any = None, result: Any = None, error: BaseException | str | None = None,
              status: Literal["ok", "error"] | None = None, call_id: str | None = None) -> None:
    """A finished tool call, as a GenAI `execute_tool {name}` span. Its status (error if `error` is given, else ok,
    unless `status` says otherwise) is the runtime signal AIR rewards. Non-string arguments/results are stored as
    JSON (str() for what JSON cannot hold); an exception error is recorded as an `exception` event."""
    attempt = current_attempt.get()
    if attempt is None:
        return
    attributes: dict[str, Any] = {semconv.OPERATION: semconv.EXECUTE_TOOL, semconv.TOOL_NAME: name}
    if call_id is not None:
        attributes[semconv.TOOL_CALL_ID] = call_id
    if arguments is not None:
        attributes[semconv.TOOL_CALL_ARGUMENTS] = _text(arguments)
    if result is not None:
        attributes[semconv.TOOL_CALL_RESULT] = _text(result)
    exception = error if isinstance(error, BaseException) else None
    message = None
    if error is not None:
        attributes[semconv.ERROR_TYPE] = exception_type(error) if exception else semconv.ERROR_TYPE_OTHER
        message = f"{type(error).__name__}: {error}" if exception else str(error)
    attempt.tracer.record(f"{semconv.EXECUTE_TOOL} {name}", attributes, status or ("error" if error else "ok"),
                          message, exception)


def _text(value: Any) -> str:
    # A tool's result may be any object: what JSON cannot hold is kept as its str() rather than failing the agent.
    return value if isinstance(value, str) else json.dumps(value, default=str)


def emit_message(text: str) -> None:
    """A `message` span carrying free text (a log line worth keeping with the rollout)."""
    attempt = current_attempt.get()
    if attempt is not None:
        attempt.tracer.record(semconv.MESSAGE, {semconv.MESSAGE_TEXT: str(text)})


def emit_object(obj: Any) -> None:
    """An `object` span carrying a JSON-serialisable object as JSON text (raises TypeError for anything else)."""
    attempt = current_attempt.get()
    if attempt is not None:
        attempt.tracer.record(semconv.OBJECT, {semconv.OBJECT_JSON: json.dumps(obj)})


def emit_exception(exc: BaseException) -> None:
    """An `exception` span with status error and OpenTelemetry's exception event (type, message, stacktrace)."""
    attempt = current_attempt.get()
    if attempt is not None:
        attempt.tracer.record(semconv.EXCEPTION, {}, "error", f"{type(exc).__name__}: {exc}", exc)
