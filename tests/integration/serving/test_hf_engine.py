"""The HF engine's continuous batching on the tiny model: requests in flight decode together, requests that arrive
mid-way join the batch, ones that end or hang up leave it, and every request gets what it would get alone (the same
tokens; logprobs within float32 rounding of a plain HF forward pass)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import ATOL, logprob_error
from lightning_ray.serving.engines import SamplingParams, generate, make_engine
from lightning_ray.tasks import calc


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return make_engine("hf", str(tiny_model_path), max_model_len=512)


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def prompts(engine, n: int) -> list[list[int]]:
    """calc questions of different lengths (the batch is left-padded to the longest)."""
    tok = engine.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t.input["question"]}], tokenize=False,
                                               add_generation_prompt=True)) for t in calc.make_tasks(n, seed=7)]


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def test_concurrent_requests_get_what_each_gets_alone(engine, model):
    ps = prompts(engine, 8)
    assert len({len(p) for p in ps}) > 1  # the batch needs padding
    alone = [asyncio.run(generate(engine, p, GREEDY)) for p in ps]

    async def together():  # half at once, the rest joining while the first are mid-way
        first = [asyncio.create_task(generate(engine, p, GREEDY)) for p in ps[:4]]
        await asyncio.sleep(0.05)
        return await asyncio.gather(*first, *(generate(engine, p, GREEDY) for p in ps[4:]))

    for p, a, b in zip(ps, alone, asyncio.run(together())):
        assert b.token_ids == a.token_ids and len(b.token_ids) == 24
        assert logprob_error(model, p, b.token_ids, b.logprobs) < ATOL


@pytest.mark.parametrize("params", [dict(temperature=0.6, seed=1), dict(temperature=0.6, top_p=0.9, seed=2)])
def test_a_sampled_tokens_logprob_is_under_the_distribution_it_was_drawn_from(engine, model, params):
    """The call's temperature and nucleus, as vLLM's processed_logprobs: what the learner compares and
    importance-weights against (it scores each token at its call's temperature)."""
    p = prompts(engine, 1)[0]
    g = asyncio.run(generate(engine, p, SamplingParams(max_tokens=24, ignore_eos=True, **params)))
    sampling = {k: v for k, v in params.items() if k != "seed"}
    assert logprob_error(model, p, g.token_ids, g.logprobs, **sampling) < ATOL
    assert logprob_error(model, p, g.token_ids, g.logprobs) > 0.01  # not the untempered ones


def test_requests_decode_in_the_same_steps(engine):
    """Each request's tokens come while the others' do, not one request after another."""
    ps, order = prompts(engine, 4), []

    async def consume(i, p):
        async for _ in engine.stream(p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)):
            order.append(i)

    async def main():
        await asyncio.gather(*(consume(i, p) for i, p in enumerate(ps)))

    asyncio.run(main())
    assert len(order) == 64
    # one at a time would give 0 ×16, 1 ×16, ...: decoding together, every request has its first tokens out before
    # any has its last
    assert max(order.index(i) for i in range(4)) < min(len(order) - 1 - order[::-1].index(i) for i in range(4))


def test_seeded_sampling_is_the_same_alone_and_batched(engine):
    ps = prompts(engine, 4)
    params = [SamplingParams(max_tokens=20, temperature=1.0, seed=i) for i in range(4)]
    alone = [asyncio.run(generate(engine, p, s)) for p, s in zip(ps, params)]

    async def together():
        return await asyncio.gather(*(generate(engine, p, s) for p, s in zip(ps, params)))

    assert [g.token_ids for g in asyncio.run(together())] == [g.token_ids for g in alone]


def test_a_request_that_hangs_up_leaves_the_others_going(engine, model):
    ps = prompts(engine, 3)
    expected = asyncio.run(generate(engine, ps[1], GREEDY))

    async def main():
        async def hang_up_after(n):
            seen = 0
            params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            async with contextlib.aclosing(engine.stream(ps[0], params)) as deltas:  # closed as a server does
                async for _ in deltas:
                    seen += 1
                    if seen == n:
                        return seen

        return await asyncio.gather(hang_up_after(3), generate(engine, ps[1], GREEDY),
                                    generate(engine, ps[2], GREEDY))

    seen, kept, other = asyncio.run(main())
    assert seen == 3
    assert kept.token_ids == expected.token_ids
    assert len(other.token_ids) == 24 and logprob_error(model, ps[2], other.token_ids, other.logprobs) < ATOL


def test_a_context_past_the_models_positions_is_refused_at_the_start(tiny_model_path):
    """As vLLM refuses it: served, its positions past the model's would be ones it never learned."""
    with pytest.raises(ValueError, match=r"engine.max_model_len=4096 is more than the model's 2048 positions"):
        make_engine("hf", str(tiny_model_path), max_model_len=4096)


def test_max_num_seqs_makes_the_rest_wait_their_turn(tiny_model_path):
    small = make_engine("hf", str(tiny_model_path), max_num_seqs=2)
    ps = prompts(small, 5)

    async def together():
        return await asyncio.gather(*(generate(small, p, GREEDY) for p in ps))

    gens = asyncio.run(together())
    assert [g.token_ids for g in gens] == [asyncio.run(generate(small, p, GREEDY)).token_ids for p in ps]


def test_a_step_that_fails_fails_its_requests_and_the_engine_serves_the_next(engine):
    """A prompt id past the vocabulary fails the model's forward pass: its request gets the error, not a hang, and
    the decoding thread goes on."""
    vocab = engine.model.config.vocab_size
    with pytest.raises(IndexError):
        asyncio.run(generate(engine, [1, 2, vocab + 5], GREEDY))
    assert len(asyncio.run(generate(engine, prompts(engine, 1)[0], GREEDY)).token_ids) == 24


def test_out_of_memory_halves_the_batch_and_loses_no_request(tiny_model_path):
    """A device that runs out of memory in a step (raised here by a hook whenever more than 2 rows go through the
    model: this machine has no GPU to fill): the step's requests go back to the queue and decode fewer at a time,
    each with the tokens it gets alone; the batch grows back once steps fit again."""
    small = make_engine("hf", str(tiny_model_path), max_num_seqs=8)
    ps = prompts(small, 6)
    alone = [asyncio.run(generate(small, p, GREEDY)).token_ids for p in ps]
    raised = []

    def too_many_rows(module, args, kwargs):
        if kwargs["input_ids"].shape[0] > 2:
            raised.append(kwargs["input_ids"].shape[0])
            raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")

    async def together():
        return await asyncio.gather(*(generate(small, p, GREEDY) for p in ps))

    hook = small.model.register_forward_pre_hook(too_many_rows, with_kwargs=True)
    try:
        gens = asyncio.run(together())
    finally:
        hook.remove()
    assert raised and small.max_num_seqs <= 2
    assert [g.token_ids for g in gens] == alone
    # once steps fit again (the hook gone), it doubles back to the configured 8, every 3 steps that fit here
    small.regrow_after = 3
    gens = asyncio.run(together())
    assert small.max_num_seqs == 8
    assert [g.token_ids for g in gens] == alone


def test_forced_tokens_are_scored_in_one_pass_beside_a_decoding_batch(engine, model):
    """Forced tokens (a teacher's answer, a prompt scored) skip the batch: one forward pass, the log-softmax taken a
    slice of positions at a time, each token's logprob and top alternatives as a plain forward pass gives them, while
    other requests go on decoding."""
    prompt, answer = prompts(engine, 2)
    forced = answer[1:]  # a prompt scored after its first token, as echo with logprobs asks
    engine.score_rows = 3  # slices of 3 positions: a slice boundary falls inside every prompt
    try:
        async def both():
            decoding = asyncio.create_task(generate(engine, prompt, GREEDY))
            await asyncio.sleep(0.02)
            scored = await generate(engine, answer[:1], SamplingParams(
                max_tokens=len(forced), forced_token_ids=forced, ignore_eos=True, top_logprobs=2))
            return scored, await decoding

        scored, decoded = asyncio.run(both())
    finally:
        del engine.score_rows
    assert scored.token_ids == forced and (scored.finish_reason, len(decoded.token_ids)) == ("length", 24)
    assert logprob_error(model, answer[:1], forced, scored.logprobs) < ATOL
    with torch.inference_mode():
        expected = torch.log_softmax(model(torch.tensor([answer])).logits[0, :-1], -1).topk(2)
    assert [list(top) for top in scored.top_logprobs] == expected.indices.tolist()
    got = torch.tensor([list(top.values()) for top in scored.top_logprobs])
    assert (got - expected.values).abs().max() < ATOL
