"""adamw_step over flat buffers gives torch.optim.AdamW(foreach=True) + clip_grad_norm_ numbers."""

from __future__ import annotations

import pytest
import torch

from bios.kernels.adamw import adamw_step

HYPER = dict(lr=3e-2, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1)


def _reference_run(shapes, grads_per_step, dtype, grad_clip_norm):
    """Plain PyTorch: separate parameters, AdamW(foreach=True), clip_grad_norm_ before each step."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, dtype=dtype)) for shape in shapes]
    optimizer = torch.optim.AdamW(
        params,
        lr=HYPER["lr"],
        betas=(HYPER["beta1"], HYPER["beta2"]),
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
        foreach=True,
    )
    norms = []
    for grads in grads_per_step:
        for param, grad in zip(params, grads):
            param.grad = grad.clone()
        if grad_clip_norm > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, grad_clip_norm)))
        else:
            norms.append(float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))))
        optimizer.step()
    return [p.detach() for p in params], norms


def _flat_run(shapes, grads_per_step, dtype, grad_clip_norm, as_list):
    """The same run with adamw_step on one flat buffer (or on a list of tensors)."""
    torch.manual_seed(0)
    start = [torch.randn(shape, dtype=dtype) for shape in shapes]
    flat = torch.cat([t.flatten() for t in start])
    exp_avg, exp_avg_sq, grad = torch.zeros_like(flat), torch.zeros_like(flat), torch.zeros_like(flat)
    norms = []
    for step, grads in enumerate(grads_per_step, start=1):
        grad.copy_(torch.cat([g.flatten() for g in grads]))
        if as_list:
            sizes = [g.numel() for g in grads]
            args = [list(t.split(sizes)) for t in (flat, grad, exp_avg, exp_avg_sq)]
        else:
            args = [flat, grad, exp_avg, exp_avg_sq]
        norms.append(adamw_step(*args, step=step, grad_clip_norm=grad_clip_norm, **HYPER))
    params = [p.view(shape) for p, shape in zip(flat.split([torch.Size(s).numel() for s in shapes]), shapes)]
    return params, norms


@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-7), (torch.float32, 1e-5)])
@pytest.mark.parametrize("grad_clip_norm", [0.0, 0.5])
@pytest.mark.parametrize("as_list", [False, True])
def test_adamw_step_matches_torch_adamw(dtype, rtol, grad_clip_norm, as_list):
    shapes = [(4, 8), (16, 4), (5,)]
    generator = torch.Generator().manual_seed(1)
    grads_per_step = [[torch.randn(shape, generator=generator, dtype=dtype) for shape in shapes] for _ in range(5)]

    expected, expected_norms = _reference_run(shapes, grads_per_step, dtype, grad_clip_norm)
    actual, norms = _flat_run(shapes, grads_per_step, dtype, grad_clip_norm, as_list)

    for want, got in zip(expected, actual):
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * 1e-2)
    assert norms == pytest.approx(expected_norms, rel=rtol)
    if grad_clip_norm > 0:
        assert min(norms) > grad_clip_norm  # the clipping branch really ran


def test_adamw_step_clips_in_place_and_returns_pre_clip_norm():
    grad = torch.tensor([3.0, 4.0])
    params, exp_avg, exp_avg_sq = torch.zeros(2), torch.zeros(2), torch.zeros(2)
    norm = adamw_step(
        params, grad, exp_avg, exp_avg_sq, step=1, lr=0.1, beta1=0.9, beta2=0.95, eps=1e-12,
        weight_decay=0.0, grad_clip_norm=1.0,
    )
    assert norm == pytest.approx(5.0)
    torch.testing.assert_close(grad, torch.tensor([3.0, 4.0]) / (5.0 + 1e-6))


def test_adamw_step_rejects_step_zero():
    buffers = [torch.zeros(2) for _ in range(4)]
    with pytest.raises(ValueError, match="1-based"):
        adamw_step(*buffers, step=0, lr=0.1, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0)
