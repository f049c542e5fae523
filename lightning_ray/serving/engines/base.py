"""The engine interface the server talks to. vLLM (issue 3) and HF transformers both sit behind it."""

from __future__ import annotations

from typing import Protocol

from pydantic import BaseModel


class SamplingParams(BaseModel):
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None


class Generation(BaseModel):
    """What the engine produced, token for token: training uses these ids and logprobs as they are."""

    token_ids: list[int]
    logprobs: list[float]  # log p(token) under the serving policy, untempered
    finish_reason: str  # "stop" (end of sequence) or "length"
    policy_version: int  # the weights that produced it, read under the same lock as the generation


class Engine(Protocol):
    tokenizer: object

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation: ...

    def load_weights(self, state_dict: dict, version: int) -> None: ...
