"""POST /v1/completions: raw prompts — text, or token ids in and token ids out (what an RL client wants)."""

from __future__ import annotations

import time
import uuid

from lightning_ray.serving.decoding import collect_all, usage
from lightning_ray.serving.http import ApiError, CallTrace
from lightning_ray.serving.schemas import CompletionRequest
from lightning_ray.serving.sse import sse_response


async def create_completion(server, body: CompletionRequest, trace: CallTrace):
    await server.check_request(body)
    if body.suffix:
        raise ApiError(422, "suffix (fill-in-the-middle) is not supported", param="suffix", code="unsupported")
    if body.best_of and body.best_of != body.n:
        raise ApiError(422, "best_of other than n is not supported", param="best_of", code="unsupported")
    if body.echo and body.logprobs is not None:
        raise ApiError(422, "echo with logprobs (prompt scoring) is not supported", param="echo", code="unsupported")
    prompts = [server.encode_text(p) if isinstance(p, str) else server.check_token_ids(p) for p in body.prompts()]
    asked = "max_tokens" in body.model_fields_set  # else the API's default, 16, cut to the room left
    _, deltas = server.generate("completions", body, trace, prompts, body.max_tokens, asked, n=body.n,
                                stop=body.stop_list, top_logprobs=body.logprobs or 0)
    meta = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": server.model_name}
    prefix = {p * body.n + i: server.tokenizer.decode(ids) if body.echo else ""
              for p, ids in enumerate(prompts) for i in range(body.n)}
    prompt_tokens = sum(len(ids) for ids in prompts)
    if body.stream:
        return sse_response(_chunks(server, body, deltas, meta, prefix, prompt_tokens))
    choices = await collect_all(deltas)
    out = [{"index": c.index, "text": prefix[c.index] + c.text, "finish_reason": c.finish_reason,
            "token_ids": c.token_ids, "prompt_token_ids": prompts[c.index // body.n],
            "logprobs": _logprobs(server, c.token_ids, c.logprobs, c.top_logprobs) if body.logprobs is not None
            else None} for c in choices]
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return {**meta, "choices": out, "system_fingerprint": server.fingerprint(choices[0].policy_version),
            "usage": usage(prompt_tokens, completion_tokens)}


async def _chunks(server, body: CompletionRequest, deltas, meta: dict, prefix: dict[int, str], prompt_tokens: int):
    completion_tokens, started = 0, set()
    async for d in deltas:
        completion_tokens += len(d.token_ids)
        text = d.text if d.index in started else prefix[d.index] + d.text
        started.add(d.index)
        yield {**meta, "system_fingerprint": server.fingerprint(d.policy_version), "choices": [{
            "index": d.index, "text": text, "finish_reason": d.finish_reason, "token_ids": d.token_ids,
            "logprobs": _logprobs(server, d.token_ids, d.logprobs, d.top_logprobs) if body.logprobs is not None else None}]}
    if body.stream_options and body.stream_options.include_usage:
        yield {**meta, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


def _logprobs(server, ids: list[int], lps: list[float], tops: list[dict[int, float]]) -> dict:
    """The legacy completions logprobs shape: parallel lists, top alternatives keyed by token text."""
    tokens = [server.tokenizer.decode([t]) for t in ids]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": lps, "text_offset": offsets,
            "top_logprobs": [{server.tokenizer.decode([t]): lp for t, lp in top.items()} for top in tops] or None}
