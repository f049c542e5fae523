"""The HF engine's sampler: every row of a batch's logits at once, with no host round trip per row.

A row is drawn from softmax(logits / temperature) within its top_p nucleus by the exponential race: the argmax of
p / E with E ~ Exp(1) is a draw of the categorical p, and needs only noise, a division and an argmax, the same kernels
for the whole batch. A seeded request's noise comes from its own generator, so its tokens do not depend on the
requests beside it; the others share the device's generator.
"""

from __future__ import annotations

import math

import torch

# As vLLM: a smaller temperature would overflow logits / T (found by the fuzz test). The server's SamplingParams raise
# any above 0 to 0.01 first, as vLLM does
GREEDY_BELOW = 1e-5


def sample(logits: torch.Tensor, temperature: list[float], top_p: list[float],
           generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """One token id per row of `logits` [rows, vocab] (float32), each with its request's temperature, top_p and
    generator (None: the device's); a temperature below GREEDY_BELOW is greedy (the argmax). And each row's
    log-probabilities under the distribution it was drawn from (vLLM's `processed_logprobs`): the softmax at the
    row's temperature within its nucleus, renormalized; a greedy row's untempered, over the whole vocabulary (vLLM
    resets a greedy request's top_p), which the learner scores it at."""
    greedy = logits.argmax(-1)
    sampled_rows = [t >= GREEDY_BELOW for t in temperature]
    device = logits.device
    t = torch.tensor([v if sampled else 1.0 for v, sampled in zip(temperature, sampled_rows)], device=device)
    logprobs = torch.log_softmax(logits / t[:, None], -1)
    top_p = [p if sampled else 1.0 for p, sampled in zip(top_p, sampled_rows)]
    if any(p < 1.0 for p in top_p):  # outside the smallest prefix (by probability) whose mass reaches top_p: -inf
        p = torch.tensor(top_p, device=device)
        sorted_logprobs, order = logprobs.sort(-1, descending=True)
        sorted_probs = sorted_logprobs.exp()
        # a row with top_p 1 keeps every token: its float32 cumsum reaches 1 before the tail
        outside = (sorted_probs.cumsum(-1) - sorted_probs >= p[:, None]) & (p[:, None] < 1.0)
        logprobs = torch.log_softmax(logprobs.scatter(-1, order, sorted_logprobs.masked_fill(outside, -math.inf)), -1)
    if not any(sampled_rows):
        return greedy, logprobs
    noise = torch.rand_like(logprobs)
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].uniform_(generator=generator)
    # -log U ~ Exp(1) (torch's exponential_ takes 3x as long on CPUs); tiny at the least: 0 / 0 would be NaN
    race = (logprobs.exp() / noise.log_().neg_().clamp_(min=torch.finfo(noise.dtype).tiny)).argmax(-1)
    return torch.where(torch.tensor(sampled_rows, device=device), race, greedy), logprobs
