"""Prepacked frozen weights for decode steps (bios.kernels.prepacked): inside `prepacked_weights()` fp32 and
bf16 products on CPU multiply by a oneDNN-laid-out copy of the weight, made once and kept; the numbers are those
of the plain weight; nothing is packed outside the block, with `BIOS_PREPACK=off` or `BIOS_GEMM=aten`, or when
the copy would not fit in memory; a freed weight's copy is no longer counted."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import bios.kernels.prepacked as prepacked_module
from bios.kernels.frozen_matmul import frozen_linear, onednn_linear
from bios.kernels.prepacked import prepacked, prepacked_bytes, prepacked_weights


def _inputs(dtype=torch.float32, rows=16):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 96, generator=generator).to(dtype)
    weight = torch.randn(200, 96, generator=generator).to(dtype)
    bias = torch.randn(200, generator=generator).to(dtype)
    return x, weight, bias


@pytest.fixture(autouse=True)
def _defaults(monkeypatch):
    monkeypatch.delenv("BIOS_PREPACK", raising=False)
    monkeypatch.delenv("BIOS_GEMM", raising=False)


def test_decode_products_multiply_by_one_kept_copy_with_the_plain_weights_numbers():
    x, weight, bias = _inputs()
    with torch.inference_mode(), prepacked_weights():
        first = frozen_linear(x, weight, bias)
        copy = prepacked(x, weight)
        again = frozen_linear(x[:7], weight, bias)
        assert prepacked(x[:7], weight) is copy  # made once, kept on the weight
        rows3d = frozen_linear(x[:, None], weight, bias)
    assert copy is not None and copy.is_mkldnn
    assert torch.equal(first, onednn_linear(x, weight, bias))  # oneDNN's own numbers, bit for bit
    torch.testing.assert_close(first, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(again, F.linear(x[:7], weight, bias), rtol=1e-5, atol=1e-4)
    assert rows3d.shape == (16, 1, 200)
    torch.testing.assert_close(rows3d[:, 0], first, rtol=1e-5, atol=1e-4)


def test_bf16_decode_products_agree_with_pytorchs():
    x, weight, bias = _inputs(torch.bfloat16)
    with torch.inference_mode(), prepacked_weights():
        result = frozen_linear(x, weight, bias)
        assert prepacked(x, weight) is not None
    torch.testing.assert_close(result.float(), F.linear(x.float(), weight.float(), bias.float()), rtol=2e-2,
                               atol=0.25)


def test_a_weight_changed_in_place_gets_a_new_copy():
    x, weight, _ = _inputs()
    with torch.inference_mode(), prepacked_weights():
        old = prepacked(x, weight)
        weight.mul_(2)
        new = prepacked(x, weight)
        result = frozen_linear(x, weight)
    assert new is not old
    torch.testing.assert_close(result, F.linear(x, weight), rtol=1e-5, atol=1e-4)


def test_nothing_is_packed_outside_the_block_when_off_or_for_aten(monkeypatch):
    x, weight, bias = _inputs()
    assert prepacked(x, weight) is None  # outside prepacked_weights()
    monkeypatch.setenv("BIOS_PREPACK", "off")
    with prepacked_weights():
        assert prepacked(x, weight) is None
    monkeypatch.setenv("BIOS_PREPACK", "auto")
    monkeypatch.setenv("BIOS_GEMM", "aten")
    with torch.inference_mode(), prepacked_weights():
        frozen_linear(x, weight, bias)
    assert not hasattr(weight, "_bios_prepacked")
    monkeypatch.setenv("BIOS_PREPACK", "sometimes")
    with pytest.raises(ValueError, match="BIOS_PREPACK must be 'auto' or 'off'"), prepacked_weights():
        pass


def test_a_copy_that_would_not_fit_in_memory_is_not_made(monkeypatch):
    x, weight, bias = _inputs()
    tight = SimpleNamespace(total=1 << 40, available=weight.numel() * weight.element_size())  # under 2x the copy
    monkeypatch.setattr(prepacked_module.psutil, "virtual_memory", lambda: tight)
    with torch.inference_mode(), prepacked_weights():
        assert prepacked(x, weight) is None
        torch.testing.assert_close(frozen_linear(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


def test_a_freed_weights_copy_is_no_longer_counted():
    x, weight, _ = _inputs()
    before = prepacked_bytes()
    with torch.inference_mode(), prepacked_weights():
        prepacked(x, weight)
    assert prepacked_bytes() == before + weight.numel() * 4
    del weight
    gc.collect()
    assert prepacked_bytes() == before
