"""POST /v1/completions: raw prompts — text, or token ids in and token ids out (what an RL client wants)."""

from __future__ import annotations

import asyncio
import time
import uuid

from lightning_ray.serving.decoding import ChoiceDelta, collect_all, usage
from lightning_ray.serving.engines import Generation, SamplingParams, generate
from lightning_ray.serving.http import ApiError, CallTrace
from lightning_ray.serving.schemas import CompletionRequest
from lightning_ray.serving.sse import sse_response


async def create_completion(server, body: CompletionRequest, trace: CallTrace):
    await server.check_request(body)
    if body.suffix:
        raise ApiError(422, "suffix (fill-in-the-middle) is not supported", param="suffix", code="unsupported")
    if body.best_of and body.best_of != body.n:
        raise ApiError(422, "best_of other than n is not supported", param="best_of", code="unsupported")
    prompts = [server.encode_text(p) if isinstance(p, str) else server.check_token_ids(p) for p in body.prompts()]
    if body.max_tokens == 0:  # the prompt alone (echo): nothing generated, nothing recorded
        for ids in prompts:  # room for one token beside it, as vLLM's scoring pass needs (it generates one)
            server.fit_length(ids, SamplingParams(max_tokens=1), 1)
        deltas = None
    else:  # checked now, generated once read (after the prompts are scored)
        asked = "max_tokens" in body.model_fields_set  # else the API's default, 16, cut to the room left
        _, deltas = server.generate("completions", body, trace, prompts, body.max_tokens, asked, n=body.n,
                                    stop=body.stop_list, top_logprobs=body.logprobs or 0)
    # echo with logprobs scores the prompt too (what lm-eval's loglikelihood reads): its first token has none
    scored = await _score(server, body, trace, prompts) if body.echo and body.logprobs is not None else None
    if deltas is None:
        deltas = _nothing(len(prompts) * body.n, scored[0].policy_version if scored else server.engine.policy_version)
    meta = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": server.model_name}
    echoed = {p * body.n + i: _Echo(server.tokenizer.decode(ids), ids, scored and scored[p], body.logprobs or 0)
              if body.echo else _Echo() for p, ids in enumerate(prompts) for i in range(body.n)}
    prompt_tokens = sum(len(ids) for ids in prompts)
    if body.stream:
        return sse_response(_chunks(server, body, deltas, meta, echoed, prompt_tokens))
    choices = await collect_all(deltas)
    out = [{"index": c.index, "text": echoed[c.index].text + c.text, "finish_reason": c.finish_reason,
            "token_ids": c.token_ids, "prompt_token_ids": prompts[c.index // body.n],
            "logprobs": echoed[c.index].logprobs(server, c.token_ids, c.logprobs, c.top_logprobs)
            if body.logprobs is not None else None} for c in choices]
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return {**meta, "choices": out, "system_fingerprint": server.fingerprint(choices[0].policy_version),
            "usage": usage(prompt_tokens, completion_tokens)}


async def _score(server, body: CompletionRequest, trace: CallTrace, prompts: list[list[int]]) -> list[Generation]:
    """Each prompt's tokens after its first, scored by the policy its generation would be served by (forced decoding:
    one forward pass), between weight updates as a generation is."""
    adapter = server.adapters.adapter(body.model, trace.agent)
    async with server.gate.admit():
        return await asyncio.gather(*(generate(server.engine, ids[:1], SamplingParams(
            max_tokens=len(ids) - 1, forced_token_ids=ids[1:], ignore_eos=True, top_logprobs=body.logprobs,
            incremental=False, adapter=adapter)) if len(ids) > 1 else _unscored(server) for ids in prompts))


async def _unscored(server) -> Generation:
    return Generation(token_ids=[], logprobs=[], finish_reason="length", policy_version=server.engine.policy_version)


async def _nothing(choices: int, version: int):
    for i in range(choices):
        yield ChoiceDelta(index=i, text="", token_ids=[], logprobs=[], finish_reason="length", policy_version=version)


class _Echo:
    """What a choice starts with under echo: the prompt's text and, scored, its tokens' logprobs (the first token's
    None, as OpenAI and vLLM report it), which the choice's own follow; spent by the first chunk that carries them."""

    def __init__(self, text: str = "", prompt_ids: list[int] = (), scored: Generation | None = None, k: int = 0):
        self.text = text
        self.ids, self.lps = (list(prompt_ids), [None, *scored.logprobs]) if scored else ([], [])
        self.tops = [None, *scored.top_logprobs] if scored and k else []

    def logprobs(self, server, ids: list[int], lps: list[float], tops: list[dict[int, float]]) -> dict:
        out = _logprobs(server, self.ids + ids, self.lps + lps, self.tops + tops)
        self.ids, self.lps, self.tops = [], [], []
        return out


async def _chunks(server, body: CompletionRequest, deltas, meta: dict, echoed: dict[int, _Echo], prompt_tokens: int):
    completion_tokens = 0
    async for d in deltas:
        completion_tokens += len(d.token_ids)
        echo = echoed[d.index]
        text, echo.text = echo.text + d.text, ""  # the prompt's text goes with the choice's first chunk
        yield {**meta, "system_fingerprint": server.fingerprint(d.policy_version), "choices": [{
            "index": d.index, "text": text, "finish_reason": d.finish_reason, "token_ids": d.token_ids,
            "logprobs": echo.logprobs(server, d.token_ids, d.logprobs, d.top_logprobs)
            if body.logprobs is not None else None}]}
    if body.stream_options and body.stream_options.include_usage:
        yield {**meta, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


def _logprobs(server, ids: list[int], lps: list[float | None], tops: list[dict[int, float] | None]) -> dict:
    """The legacy completions logprobs shape: parallel lists, top alternatives keyed by token text."""
    tokens = [server.tokenizer.decode([t]) for t in ids]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": lps, "text_offset": offsets,
            "top_logprobs": [top if top is None else {server.tokenizer.decode([t]): lp for t, lp in top.items()}
                             for top in tops] or None}
