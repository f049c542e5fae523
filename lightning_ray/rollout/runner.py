"""One attempt of one rollout, wherever the agent lives: inside a Ray worker or behind the HTTP client.

`store` is any RolloutStore (store/protocol.py): the Ray StoreClient or the HTTP LightningClient. Nothing here
imports Ray.
"""

from __future__ import annotations

import contextvars
import logging
import math
import numbers
import threading
import time

import httpx
import openai
from collections.abc import Callable
from contextlib import contextmanager

from lightning_ray import auth, tracing
from lightning_ray.store.errors import BatchTooLarge, InvalidSpans, StaleAttempt, UnknownRollout
from lightning_ray.store.protocol import RolloutStore
from lightning_ray.tracing import semconv
from lightning_ray.tracing.context import current_attempt
from lightning_ray.types import Rollout, new_id

logger = logging.getLogger(__name__)

class PlatformFailure(Exception):
    """The platform failed the agent, as the agent or its runner tells (rollout/agents.py: a command's)."""


# Errors that say the platform failed the agent, not that the policy did: the endpoint unreachable, timing out or
# answering 5xx; or the agent set up wrong, which no answer of the policy's causes: a key refused (401, 403), a path
# or model not there (404: a base URL with /v1 twice, another model's name). Not trained on, and where the first
# round's every rollout ends so, the run stops saying why. (Any other 4xx, such as a prompt grown past the context
# length, is the policy's doing: it scores 0.)
INFRASTRUCTURE_ERRORS = (openai.APIConnectionError, openai.InternalServerError, openai.AuthenticationError,
                         openai.PermissionDeniedError, openai.NotFoundError, httpx.TransportError, ConnectionError,
                         TimeoutError, PlatformFailure)


# Agent threads this process left behind at a timeout (_within): they may still run, and call the policy.
ABANDONED: list[threading.Thread] = []
# Set while an attempt runs, once the store says its lease is lost (timed out, its rollout cancelled): an agent that
# can be stopped (a command: rollout/agents.py) stops then, not at its deadline, calling the policy meanwhile; one
# that cannot (a Python thread) is left behind, as at its deadline, and the worker goes on (_within).
LEASE_LOST: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar("lease_lost", default=None)


def abandoned_agents() -> int:
    """How many agent threads left behind at a timeout still run in this process."""
    ABANDONED[:] = [t for t in ABANDONED if t.is_alive()]
    return len(ABANDONED)


def work(store: RolloutStore, agent: Callable, reward: Callable, policy_url: str | Callable[[str], str], model: str,
         api_key: str | None = None, worker_id: str | None = None, tracing_backend: str = "embedded",
         max_abandoned: int | None = None, queue: str = "default") -> int:
    """Run rollouts from `queue` until it is empty, or until `max_abandoned` agent threads left behind at timeouts
    still run here (the process is then due a restart); return how many this worker ran. `policy_url`: the policy
    server's, or where a rollout's calls go, by its id (rollout/routes.py)."""
    done = 0
    while (max_abandoned is None or abandoned_agents() < max_abandoned) and \
            (rollout := _dequeue(store, worker_id, queue)) is not None:
        url = policy_url if isinstance(policy_url, str) else policy_url(rollout.rollout_id)
        run_attempt(store, rollout, agent, reward, url, model, api_key, tracing_backend)
        done += 1
    return done


def _dequeue(store: RolloutStore, worker_id: str | None, queue: str, tries: int = 5) -> Rollout | None:
    """Ask for the next rollout under an attempt id chosen here, and ask again under the same id when the store could
    not be reached: a reply lost on the way back (a store restarting) gives the same lease again, instead of a
    second rollout while the first waits out its lease (and fails, with max_attempts=1)."""
    attempt_id, failures = new_id("at"), 0
    while True:
        try:
            return store.dequeue(worker_id, attempt_id, queue)
        except StaleAttempt:  # its lease ran out before we asked again: the store retries or fails that rollout
            attempt_id = new_id("at")
        except (httpx.TransportError, ConnectionError):
            failures += 1
            if failures == tries:
                raise
            logger.warning("dequeue under %s failed; asking again", attempt_id, exc_info=True)
            time.sleep(2 ** (failures - 1))


def run_attempt(store: RolloutStore, rollout: Rollout, agent: Callable, reward: Callable, policy_url: str, model: str,
                api_key: str | None = None, tracing_backend: str = "embedded") -> None:
    """Run the unmodified agent on the rollout's task. It sees an ordinary OpenAI base URL whose path carries the
    rollout and attempt to the policy server; its spans and emitted rewards stream to the store; heartbeats keep
    the lease; the task's reward function gives the reward, so the agent needs no emitter at all. `api_key`: the
    operator's (serve.api_key); the agent gets a key for this attempt only, and the task's input without its
    reference (the expected answer), which only the reward function reads."""
    rid, aid = rollout.rollout_id, rollout.attempt_id
    base_url = f"{policy_url}/rollouts/{rid}/attempts/{aid}/v1"
    agent_key = auth.agent_key(api_key, rid, aid) if api_key else "EMPTY"
    with _heartbeats(store, rollout) as lease_lost:
        told = LEASE_LOST.set(lease_lost)
        try:
            status, value, error = _traced_attempt(store, rollout, agent, reward, base_url, model, agent_key,
                                                   tracing_backend)
        except Exception as e:  # the spans' last hand-over: a trace with calls missing is not trained on
            status, value, error = "failed", None, f"its spans did not all reach the store: {type(e).__name__}: {e}"
            logger.warning("rollout %s attempt %s: %s", rid, aid, error)
        finally:
            LEASE_LOST.reset(told)
    if lease_lost.is_set():
        logger.warning("rollout %s attempt %s lost its lease; its result is dropped", rid, aid)
        return
    try:
        store.finish_attempt(rid, aid, status, value, error)
    except StaleAttempt as e:  # timed out or went unresponsive in the store's eyes while we finished
        logger.warning("%s", e)


def _traced_attempt(store: RolloutStore, rollout: Rollout, agent: Callable, reward: Callable, base_url: str,
                    model: str, agent_key: str, tracing_backend: str) -> tuple[str, float | None, str | None]:
    """The agent's run in the attempt's trace, and its verdict: status, reward (None: the platform failed it), error."""
    rid, aid = rollout.rollout_id, rollout.attempt_id
    with (tracing.trace_attempt(rid, aid, _span_sink(store, rid), tracing_backend),
          tracing.span(semconv.ROLLOUT, {"task_id": rollout.task.task_id}) as root):
        try:
            answer = _within(rollout.config.timeout_seconds, agent, rollout.task.input, base_url=base_url,
                             model=model, api_key=agent_key)
            value, status, error = _score(reward, rollout.task.reward_input, answer), "succeeded", None
        except AttemptTimeout as e:  # the store times the attempt out too; the agent's thread is left behind
            # scored 0 when a timeout is the policy's doing (rollout.timeout_policy), else left out of training
            answer, status, error = None, "timeout", str(e)
            value = 0.0 if rollout.config.timeout_policy == "policy" else None
        except Exception as e:  # the agent's failure is the rollout's outcome, not the worker's
            # ... and scores 0, unless the platform failed it (no reward: LightningRL leaves it out of training)
            answer, status, error = None, "failed", f"{type(e).__name__}: {e}"
            value = None if isinstance(e, INFRASTRUCTURE_ERRORS) else 0.0
            tracing.emit_exception(e)
            if isinstance(e, RewardFailed):
                logger.warning("rollout %s: %s", rid, error)
        root.set_attributes({"answer": answer, "status": status, "error": error})
        if value is not None:  # in the trace too, told from a reward the agent emitted (task.agent_rewards)
            current_attempt.get().tracer.record(semconv.REWARD, {semconv.REWARD_VALUE: value,
                                                                 semconv.REWARD_TASK: True})
    return status, value, error


def _span_sink(store: RolloutStore, rollout_id: str) -> Callable:
    """The attempt's spans to the store. A span it refuses (empty name, ends before it starts, ...) is dropped and
    said, the rest stored: it would be refused again at every try, and the batch kept for it would grow until the
    attempt's end failed. Only not reaching the store raises (SpanBatch keeps the spans and tries again)."""
    def sink(spans) -> None:
        try:
            store.add_spans(spans)
        except (InvalidSpans, UnknownRollout, BatchTooLarge) as e:  # not a 5xx: that one is tried again
            logger.warning("rollout %s: the store refused spans of its trace: %s", rollout_id, e)

    return sink


class RewardFailed(PlatformFailure):
    """The task's reward function raised, or returned no finite number: its fault, not the policy's (no reward)."""


def _score(reward: Callable, task: dict, answer) -> float:
    try:
        value = reward(task, answer)
    except PlatformFailure:  # its own word that it could not score (sql: the gold query did not run)
        raise
    except Exception as e:
        raise RewardFailed(f"the task's reward function raised {type(e).__name__}: {e}") from e
    if not isinstance(value, numbers.Real) or not math.isfinite(value):  # (True, an np.float32: numbers)
        raise RewardFailed(f"the task's reward function returned {value!r}, not a finite number")
    return float(value)


class AttemptTimeout(Exception):
    """The agent ran past its attempt's deadline (rollout.timeout_seconds)."""


class AttemptAbandoned(Exception):
    """The attempt's lease was lost while its agent ran: no one will take its result."""


class AgentAborted(Exception):
    """The agent raised what is not an Exception (asyncio.CancelledError, SystemExit, KeyboardInterrupt)."""


def _within(seconds: float | None, fn: Callable, *args, **kwargs):
    """fn's result, or AttemptTimeout after `seconds` (None: no limit). fn runs on a daemon thread in the caller's
    context (so in its trace); a Python thread cannot be stopped, so one that never returns is left behind instead
    of holding this worker forever."""
    if seconds is None:
        return fn(*args, **kwargs)
    outcome: dict = {}
    context = contextvars.copy_context()

    def run():
        try:
            outcome["value"] = context.run(fn, *args, **kwargs)
        except Exception as e:  # re-raised on the caller's thread
            outcome["error"] = e
        except BaseException as e:  # no signal reaches this thread: the agent's own (a CancelledError escaping
            # asyncio, sys.exit), its failure as any exception is, not the worker's end
            outcome["error"] = AgentAborted(f"the agent raised {type(e).__name__}: {e}")

    thread = threading.Thread(target=run, daemon=True, name="agent")
    thread.start()
    deadline, lease_lost = time.monotonic() + seconds, LEASE_LOST.get()
    while thread.is_alive() and (left := deadline - time.monotonic()) > 0:
        thread.join(min(left, 1.0))
        if lease_lost is not None and lease_lost.is_set() and thread.is_alive():  # its result would be dropped:
            ABANDONED.append(thread)  # the worker goes on to the next rollout
            raise AttemptAbandoned("the attempt's lease was lost (its rollout cancelled or timed out in the store); "
                                   "the agent's thread was abandoned")
    if thread.is_alive():
        ABANDONED.append(thread)
        raise AttemptTimeout(f"the agent ran past rollout.timeout_seconds={seconds:g}; its thread was abandoned")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@contextmanager
def _heartbeats(store: RolloutStore, rollout: Rollout):
    """Beat at a third of the lease while the agent runs; set the event if the store says the lease is lost."""
    lost, stop = threading.Event(), threading.Event()
    every = (rollout.config.unresponsive_seconds or 30.0) / 3

    def beat():
        while not stop.wait(every):
            try:
                store.heartbeat(rollout.rollout_id, rollout.attempt_id)
            except StaleAttempt:
                lost.set()
                return
            except Exception:  # a store restarting: keep beating, the lease has slack
                logger.warning("heartbeat for %s failed; retrying", rollout.attempt_id, exc_info=True)

    thread = threading.Thread(target=beat, daemon=True, name=f"heartbeat-{rollout.attempt_id}")
    thread.start()
    try:
        yield lost
    finally:
        stop.set()
        thread.join()
