"""The cascade attention of a decode step's rows of one prompt in one C call (bios.kernels.decode_attention): the
numbers of PyTorch's ops (`decode_cache.cascade_attention` without the kernels) to fp32 rounding, for head widths
with a fast path (64, 128) and without, grouped-query heads in groups of fewer or more than the kernel takes at
once, rows with no own positions yet, and a bf16 query; None where the kernels are off."""

from __future__ import annotations


import pytest
import torch
from conftest import needs_c_kernels

from bios.kernels.decode_attention import cascade_attention_kernel
from bios.worker.decode_cache import cascade_attention

pytestmark = [needs_c_kernels, pytest.mark.usefixtures("fresh_c_kernels")]


def _inputs(rows, heads, kv_heads, width, prompt, own, room, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    query = randn(rows, heads + 2 * kv_heads, width)[:, :heads]  # a slice of q/k/v side by side, as decoded
    prompt_keys, prompt_values = randn(kv_heads, prompt, width), randn(kv_heads, prompt, width)
    keys, values = randn(rows, kv_heads, room, width), randn(rows, kv_heads, room, width)
    return query, prompt_keys, prompt_values, keys[:, :, :own], values[:, :, :own]


@pytest.mark.parametrize("rows,heads,kv_heads,width,prompt,own", [
    (16, 9, 3, 64, 50, 10),  # SmolLM2's shape
    (4, 10, 2, 128, 30, 5),  # five query heads a kv head: four at once, then one
    (3, 4, 4, 64, 1, 0),  # one prompt position, no own ones yet
    (5, 8, 2, 17, 7, 3),  # a width without a fast path
    (2, 16, 2, 64, 3, 40),  # more own positions than the prompt's
])
def test_the_kernel_attends_as_pytorchs_ops_do(rows, heads, kv_heads, width, prompt, own, monkeypatch):
    inputs = _inputs(rows, heads, kv_heads, width, prompt, own, room=own + 4)
    fused = cascade_attention_kernel(*inputs, scaling=width**-0.5)
    monkeypatch.setenv("BIOS_C_KERNELS", "off")
    assert cascade_attention_kernel(*inputs, scaling=width**-0.5) is None
    reference = cascade_attention(*inputs, scaling=width**-0.5)
    assert fused is not None and fused.shape == (rows, heads * width)
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)


def test_a_bf16_query_reads_the_fp32_cache_and_answers_in_bf16(monkeypatch):
    query, *cache = _inputs(8, 9, 3, 64, 20, 6, room=10)
    fused = cascade_attention_kernel(query.bfloat16(), *cache, scaling=0.125)
    monkeypatch.setenv("BIOS_C_KERNELS", "off")
    reference = cascade_attention(query.bfloat16(), *cache, scaling=0.125)
    assert fused.dtype == torch.bfloat16
    torch.testing.assert_close(fused, reference, rtol=2e-2, atol=2e-2)
    assert cascade_attention_kernel(query, *[t.bfloat16() for t in cache], scaling=0.125) is None  # bf16 cache
