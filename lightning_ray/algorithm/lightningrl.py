"""LightningRL: an agent's trace becomes single-turn RL data.

Only the policy model's calls become transitions (an agent may call other models too), ordered by time. Credit
assignment, in the paper's simplest form: every transition of an episode receives the episode's reward.
"""

from __future__ import annotations

from lightning_ray.tracing import semconv
from lightning_ray.types import Rollout, Span, Transition


def transitions_from_spans(rollout: Rollout, spans: list[Span], policy_model: str) -> list[Transition]:
    spans = [s for s in spans if s.attempt_id == rollout.attempt_id]  # the attempt that ended the rollout
    rewards = [s.attributes[semconv.REWARD_VALUE] for s in spans if s.name == semconv.REWARD]
    reward = rewards[-1] if rewards else (rollout.reward or 0.0)
    calls = [s for s in spans if s.name == semconv.LLM_CALL and s.attributes.get(semconv.MODEL) == policy_model]
    return [
        Transition(
            rollout_id=rollout.rollout_id,
            group_id=rollout.task.group_id or rollout.task.task_id,
            span_id=s.span_id,
            prompt_ids=s.attributes[semconv.PROMPT_TOKEN_IDS],
            response_ids=s.attributes[semconv.COMPLETION_TOKEN_IDS],
            logprobs=s.attributes[semconv.LOGPROBS],
            reward=reward,
            policy_version=s.attributes[semconv.POLICY_VERSION],
        )
        for s in sorted(calls, key=lambda s: s.start_time)
    ]
