"""The engine interface the server talks to. vLLM and HF transformers both sit behind it.

An engine streams token deltas for one prompt; `generate` collects them. Token ids and logprobs are the engine's
own, exactly as sampled: training uses them as they are, never re-tokenizing text.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Protocol

from pydantic import BaseModel, Field, field_validator, model_validator

LOWEST_TEMPERATURE = 0.01  # vLLM's: it samples a lower one (but 0, greedy) at this, with a warning


def end_ids(tokenizer_eos: int | None, configured: int | list[int] | None) -> set[int]:
    """Every end-of-sequence id an engine stops on, as vLLM does: the tokenizer's and the generation config's (one or
    a list; chat models often end turns on a token of their own, Llama 3.1's <|eom_id|> only there)."""
    return {i for i in [tokenizer_eos, *(configured if isinstance(configured, list) else [configured])]
            if i is not None}


class SamplingParams(BaseModel):
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    top_logprobs: int = Field(0, ge=0, le=20)  # alternatives to report per token (logprobs come always)
    stop_token_ids: list[int] = []  # besides the tokenizer's end-of-sequence token
    ignore_eos: bool = False  # generate exactly max_tokens
    # False: the caller needs only the finished generation (no stream, no stop strings to watch for), so an
    # engine may deliver it in one delta, skipping per-token work (vLLM: FINAL_ONLY outputs).
    incremental: bool = True
    # Constrained decoding: the output is JSON valid under this schema ({"type": "object"}: any JSON object),
    # then a stop token. Schemas reaching an engine passed grammar.check_json_schema.
    json_schema: dict[str, Any] | None = None
    # Forced decoding: these tokens are the generation (up to the first stop token), each reported with its logprob
    # under the served policy, exactly as if sampled: a teacher's answer in the policy's own tokens
    # (serving/teacher.py), recorded and scored like the policy's samples; a prompt's own tokens (echo with logprobs).
    forced_token_ids: list[int] | None = Field(None, min_length=1)
    # The LoRA adapter to generate with (learner.lora: `default`; algorithm.adapters: the call's agent's); None: the
    # base model. One the engine has not loaded yet is the base (an adapter starts as the base).
    adapter: str | None = None

    @field_validator("temperature")
    @classmethod
    def _as_sampled(cls, temperature: float) -> float:
        """The temperature the tokens are drawn at, on either engine, and so recorded and trained at: 0.001 asked
        was drawn at vLLM's 0.01 while the HF engine drew it greedily, and the learner scored it at 0.001."""
        return temperature and max(temperature, LOWEST_TEMPERATURE)

    @model_validator(mode="after")
    def _no_nucleus(self):
        """top_p 1 for a greedy call, as vLLM (its logprobs over the whole vocabulary, untempered), and under a JSON
        constraint: the tokens the grammar alone allowed are told by their logprob of 0 (Transition.constrained),
        which a nucleus of one token would give too."""
        if not self.temperature or self.json_schema is not None:
            self.top_p = 1.0
        return self

    @model_validator(mode="after")
    def _json_needs_eos(self):
        if self.json_schema is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with a JSON constraint: the JSON ends with the EOS token")
        if self.json_schema is not None and self.forced_token_ids:
            raise ValueError("forced tokens cannot be combined with a JSON constraint")
        return self


class TokenDelta(BaseModel):
    """New tokens since the last delta. The last delta of a stream has finish_reason set."""

    token_ids: list[int]
    # log p(token) under the distribution the serving policy drew it from: its logits at the call's temperature,
    # renormalized within the top_p nucleus and the tokens a JSON constraint allows (vLLM's processed_logprobs); a
    # greedy or forced token's untempered
    logprobs: list[float]
    top_logprobs: list[dict[int, float]] = []  # per token, when asked for; tokens a constraint rules out are left out
    finish_reason: str | None = None  # "stop" (end of sequence or stop token) or "length"
    policy_version: int  # the weights that produced these tokens
    # [version, start, end) over the whole generation's tokens, where an engine learns them only at its end (vLLM's
    # weight_versions, on the last delta): they replace what the deltas' policy_version said
    version_spans: list[tuple[int, int, int]] | None = None


class Generation(BaseModel):
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]] = []
    finish_reason: str
    policy_version: int


class Engine(Protocol):
    tokenizer: object
    policy_version: int
    broken: str | None  # why the served weights are no longer one policy version (a load failed part way)

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenDelta]: ...

    async def stage_weights(self, state_dict: dict) -> None:
        """Check a new state dict and get it ready to swap in, while serving goes on (a bad one raises here, with
        the served weights untouched)."""

    async def swap_weights(self, version: int) -> None:
        """Make the staged weights the served ones; called with admission paused. A failure part way sets
        `broken`: the replica then reports itself unhealthy and Serve replaces it."""

    async def load_weights(self, state_dict: dict, version: int) -> None: ...


class WeightLoading:
    """`load_weights` for an engine with `stage_weights` and `swap_weights` (what tests and tools call)."""

    broken: str | None = None
    # whether the staged weights can load under running generations (serve.drain=keep); an engine says where not
    keeps_generations: bool = True

    async def load_weights(self, state_dict: dict, version: int) -> None:
        await self.stage_weights(state_dict)
        await self.swap_weights(version)


def check_weights(state_dict: dict, expected: dict[str, tuple[int, ...]]) -> None:
    """The served model's tensors, name for name and shape for shape, or a ValueError naming what differs: checked
    before anything is loaded, so a wrong publish (another model, a config mismatch) changes nothing."""
    problems = [f"missing {n}" for n in expected if n not in state_dict]
    problems += [f"unexpected {n}" for n in state_dict if n not in expected]
    problems += [f"{n} has shape {tuple(t.shape)}, the served model's is {expected[n]}" for n, t in state_dict.items()
                 if n in expected and tuple(getattr(t, "shape", ())) != expected[n]]
    if problems:
        raise ValueError(f"the published weights do not fit the served model: {'; '.join(problems[:5])}"
                         + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))


def forced_generation(params: SamplingParams, stops: set[int]) -> list[int]:
    """The forced tokens as a generation would end them: at the first stop token, or at max_tokens."""
    forced = params.forced_token_ids[:params.max_tokens]
    return forced[:next((i + 1 for i, t in enumerate(forced) if t in stops), len(forced))]


async def generate(engine: Engine, prompt_ids: list[int], params: SamplingParams) -> Generation:
    """Run a stream to its end and collect it."""
    ids, lps, tops, finish, version = [], [], [], "length", engine.policy_version
    async for d in engine.stream(prompt_ids, params):
        ids += d.token_ids
        lps += d.logprobs
        tops += d.top_logprobs
        finish, version = d.finish_reason or finish, d.policy_version
    return Generation(token_ids=ids, logprobs=lps, top_logprobs=tops, finish_reason=finish, policy_version=version)
