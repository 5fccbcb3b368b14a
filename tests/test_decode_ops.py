"""A decode step's small steps in C (bios.kernels.decode_ops): the residual add with the next RMSNorm, SwiGLU
(PyTorch's numbers to fp32 rounding) and RoPE in place (PyTorch's numbers bit for bit), for fp32 CPU tensors;
the lean decode step takes them only for fp32 hidden states on CPU where Bios's C kernels are built."""

from __future__ import annotations


import pytest
import torch
from conftest import needs_c_kernels

from bios.kernels.decode_ops import DecodeOps
from bios.kernels.norms import rms_norm, swiglu_value
from bios.worker.llama_decode import _TorchOps

pytestmark = needs_c_kernels


@pytest.fixture
def ops(fresh_c_kernels):
    return DecodeOps.for_hidden(torch.float32, torch.device("cpu"))


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("width", [576, 37])
def test_the_residual_add_and_rms_norm_match_pytorchs(ops, width):
    hidden, delta, weight = _randn(16, width), _randn(16, width, seed=1), _randn(width, seed=2)
    expected_sum = hidden + delta
    expected = rms_norm(expected_sum, weight, 1e-5)
    ours = hidden.clone()
    normed = ops.add_rms_norm(ours, delta, weight, 1e-5)
    assert torch.equal(ours, expected_sum)  # the add is in place and exact
    torch.testing.assert_close(normed, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ops.add_rms_norm(hidden, None, weight, 1e-5), rms_norm(hidden, weight, 1e-5),
                               rtol=1e-6, atol=1e-6)


def test_rope_in_place_is_pytorchs_bit_for_bit(ops):
    qkv = _randn(16, 9 + 2 * 3, 64)
    cos, sin = _randn(16, 1, 64, seed=1), _randn(16, 1, 64, seed=2)
    expected = _TorchOps.rotate(qkv[:, :12], cos, sin)
    untouched = qkv[:, 12:].clone()
    rotated = ops.rotate(qkv[:, :12], cos, sin)  # query and key heads of q/k/v side by side: rows strided
    assert torch.equal(rotated, expected) and torch.equal(qkv[:, :12], expected)
    assert torch.equal(qkv[:, 12:], untouched)  # the value heads
    with pytest.raises(ValueError, match="must be contiguous"):
        ops.rotate(qkv.transpose(1, 2), cos, sin)


@pytest.mark.parametrize("intermediate", [1536, 37])
def test_swiglu_matches_pytorchs(ops, intermediate):
    gate_up = _randn(16, 2 * intermediate) * 4  # well into both tails of silu
    gate_up[0, 0], gate_up[0, 1] = 120.0, -120.0  # past exp's clamp: silu(120) = 120, silu(-120) = 0
    result = ops.swiglu(gate_up, intermediate)
    expected = swiglu_value(gate_up[:, :intermediate], gate_up[:, intermediate:])
    torch.testing.assert_close(result, expected, rtol=1e-6, atol=1e-6)


def test_they_apply_to_fp32_cpu_hidden_states_with_the_kernels_on(ops, monkeypatch):
    assert isinstance(ops, DecodeOps)
    assert DecodeOps.for_hidden(torch.bfloat16, torch.device("cpu")) is None
    assert DecodeOps.for_hidden(torch.float32, torch.device("meta")) is None
    with pytest.raises(ValueError, match="fp32 CPU tensors"):
        ops.swiglu(torch.zeros(2, 8, dtype=torch.bfloat16), 4)
    monkeypatch.setenv("BIOS_C_KERNELS", "off")
    assert DecodeOps.for_hidden(torch.float32, torch.device("cpu")) is None
