"""A training pass's SwiGLU, RMSNorm and output-head log-softmax in C (csrc/training_ops.c through bios.kernels.norms) for fp32 CPU tensors:
forward and backward against float64 references and against PyTorch's ops (`BIOS_C_KERNELS=off`), the
recomputed activation bit for bit the forward's."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_c_kernels

from bios.kernels.norms import rms_norm, swiglu, swiglu_stacked, swiglu_stacked_value

pytestmark = [needs_c_kernels, pytest.mark.usefixtures("fresh_c_kernels")]


def _randn(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def _relative(ours, reference):
    return ((ours.double() - reference).abs().max() / reference.abs().max()).item()


def _swiglu_grads(gate_up, grad_y):
    inputs = gate_up.clone().requires_grad_()
    y = swiglu_stacked(inputs)
    y.backward(grad_y)
    return y.detach(), inputs.grad


@pytest.mark.parametrize("width", [1536, 37])  # a remainder past the last full vector
def test_stacked_swiglu_matches_float64_and_pytorchs_ops(width, monkeypatch):
    gate_up, grad_y = _randn(2, 40, 2 * width, seed=0, scale=4.0), _randn(2, 40, width, seed=1)
    reference = _swiglu_grads(gate_up, grad_y)  # float64: PyTorch's ops
    ours = _swiglu_grads(gate_up.float(), grad_y.float())
    monkeypatch.setenv("BIOS_C_KERNELS", "off")
    theirs = _swiglu_grads(gate_up.float(), grad_y.float())
    for mine, stock, exact in zip(ours, theirs, reference):
        assert _relative(mine, exact) < 1e-6 and _relative(stock, exact) < 1e-6
    gate, up = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(theirs[0], swiglu(gate, up), rtol=0, atol=0)  # the split form's numbers


def test_the_recomputed_activation_is_the_forwards_bit_for_bit():
    gate_up = _randn(64, 2 * 96, seed=2).float().requires_grad_()
    assert torch.equal(swiglu_stacked(gate_up).detach(), swiglu_stacked_value(gate_up))


@pytest.mark.parametrize("weight_trains", [False, True])
def test_rms_norm_matches_float64_and_pytorchs_ops(weight_trains, monkeypatch):
    x, weight, grad_y = _randn(3, 50, 576, seed=3, scale=3.0), _randn(576, seed=4), _randn(3, 50, 576, seed=5)

    def run(dtype):
        inputs = x.to(dtype, copy=True).requires_grad_()
        w = weight.to(dtype, copy=True).requires_grad_(weight_trains)
        y = rms_norm(inputs, w, 1e-5)
        y.backward(grad_y.to(dtype))
        return (y.detach(), inputs.grad, *((w.grad,) if weight_trains else ()))

    reference, ours = run(torch.float64), run(torch.float32)
    monkeypatch.setenv("BIOS_C_KERNELS", "off")
    theirs = run(torch.float32)
    for mine, stock, exact in zip(ours, theirs, reference):
        assert _relative(mine, exact) < 2e-6 and _relative(stock, exact) < 2e-6


@pytest.mark.parametrize("width", [576, 45])  # a remainder past the last full vector
def test_bf16_rms_norm_rounds_as_pytorchs_ops_and_its_backward_is_closer_to_float64(width, monkeypatch):
    x, weight, grad_y = _randn(3, 50, width, seed=9, scale=3.0), _randn(width, seed=10), _randn(3, 50, width, seed=11)
    x, weight, grad_y = (t.to(torch.bfloat16) for t in (x, weight, grad_y))

    def run(dtype):
        inputs = x.to(dtype, copy=True).requires_grad_()
        y = rms_norm(inputs, weight.to(dtype), 1e-5)
        y.backward(grad_y.to(dtype))
        return y.detach(), inputs.grad

    ours, reference = run(torch.bfloat16), run(torch.float64)
    assert torch.equal(rms_norm(x, weight, 1e-5), ours[0])  # without a gradient: the same kernel
    monkeypatch.setenv("BIOS_C_KERNELS", "off")
    theirs = run(torch.bfloat16)
    # The forward rounds as PyTorch's ops do; only the sum of squares' order differs, which moves x / rms by one
    # bf16 step where it lies within an fp32 rounding of a tie (the weight's product then by about as much)
    differ = ours[0] != theirs[0]
    assert differ.float().mean() < 1e-3
    assert ((ours[0] - theirs[0]).abs()[differ] <= theirs[0].abs()[differ] / 64).all()
    assert _relative(ours[1], reference[1]) <= _relative(theirs[1], reference[1]) < 1e-2


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("grads", [False, True])
def test_head_log_softmax_matches_pytorchs_ops(scaled, grads):
    from bios.kernels.cross_entropy import _c_log_softmax_, _log_softmax_

    logits = _randn(9, 1003, seed=6, scale=5.0).float()  # a remainder past the last full vector
    targets = torch.randint(0, 1003, (9,), generator=torch.Generator().manual_seed(7))
    row_scale = _randn(9, seed=8).float() if scaled else None
    results = []
    for log_softmax in (_c_log_softmax_, _log_softmax_):
        rows, logprobs, lse = logits.clone(), torch.empty(9), torch.empty(9)
        assert log_softmax(rows, targets, row_scale, logprobs, lse, grads) is not False  # the C call ran
        results.append((rows, logprobs, lse))
    compared = slice(0, 3) if grads else slice(1, 3)  # without gradients the rows are scratch
    for ours, theirs in zip(results[0][compared], results[1][compared]):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scaled", [False, True])
def test_head_log_softmax_of_bf16_logits_is_the_fp32_ones_cast_once(scaled):
    from bios.kernels.cross_entropy import _c_log_softmax_

    logits = _randn(7, 1003, seed=12, scale=5.0).to(torch.bfloat16)
    targets = torch.randint(0, 1003, (7,), generator=torch.Generator().manual_seed(13))
    row_scale = _randn(7, seed=14).float() if scaled else None
    results = []
    for rows in (logits.clone(), logits.float()):
        logprobs, lse = torch.empty(7), torch.empty(7)
        assert _c_log_softmax_(rows, targets, row_scale, logprobs, lse, True)
        results.append((rows.to(torch.bfloat16), logprobs, lse))
    for ours, theirs in zip(*results):
        assert torch.equal(ours, theirs)
