"""AdamW with global-norm gradient clipping over a few flat fp32 buffers.

An adapter keeps its parameters, gradient and both Adam moments as one flat buffer each, so a whole optimizer
step is a handful of foreach ops instead of one small kernel per LoRA matrix. The arithmetic follows
`torch.optim.AdamW(foreach=True)` (decoupled weight decay, no amsgrad) and `torch.nn.utils.clip_grad_norm_`
operation for operation, so a run here matches a plain PyTorch run to rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor

# `clip_grad_norm_` adds this to the norm before dividing, so a zero gradient never divides by zero.
_CLIP_NORM_EPS = 1e-6


def _as_list(tensors: Tensor | list[Tensor]) -> list[Tensor]:
    return [tensors] if isinstance(tensors, Tensor) else list(tensors)


@torch.no_grad()
def adamw_step(
    params: Tensor | list[Tensor],
    grads: Tensor | list[Tensor],
    exp_avg: Tensor | list[Tensor],
    exp_avg_sq: Tensor | list[Tensor],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_clip_norm: float,
    grad_norm: float | None = None,
) -> float:
    """Update `params`, `exp_avg` and `exp_avg_sq` in place; return the gradient's L2 norm before clipping.

    `step` is the 1-based count of this update (already incremented). When `grad_clip_norm > 0` the gradient
    is scaled in place by `min(grad_clip_norm / (norm + 1e-6), 1)` first, exactly like `clip_grad_norm_`.
    `grad_norm` is the norm to clip by when these tensors are only part of the gradient (a tensor-parallel
    shard: the caller took the whole gradient's norm across the group); by default it is theirs.
    """
    if step < 1:
        raise ValueError(f"adamw_step needs the 1-based step count after increment, got step={step}")
    params_l, grads_l = _as_list(params), _as_list(grads)
    exp_avg_l, exp_avg_sq_l = _as_list(exp_avg), _as_list(exp_avg_sq)
    if not len(params_l) == len(grads_l) == len(exp_avg_l) == len(exp_avg_sq_l):
        raise ValueError(
            f"adamw_step needs as many grads and moments as params: got {len(params_l)} params, "
            f"{len(grads_l)} grads, {len(exp_avg_l)} exp_avg, {len(exp_avg_sq_l)} exp_avg_sq"
        )
    if not params_l:
        return 0.0

    if grad_norm is None:
        total_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads_l, 2)), 2)
    else:
        total_norm = torch.tensor(grad_norm, dtype=grads_l[0].dtype, device=grads_l[0].device)
    if grad_clip_norm > 0:
        clip_coef = torch.clamp(grad_clip_norm / (total_norm + _CLIP_NORM_EPS), max=1.0)
        torch._foreach_mul_(grads_l, clip_coef)

    if weight_decay != 0:
        torch._foreach_mul_(params_l, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avg_l, grads_l, 1 - beta1)
    torch._foreach_mul_(exp_avg_sq_l, beta2)
    torch._foreach_addcmul_(exp_avg_sq_l, grads_l, grads_l, 1 - beta2)

    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    step_size = -(lr / bias_correction1)
    denom = torch._foreach_sqrt(exp_avg_sq_l)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params_l, exp_avg_l, denom, step_size)
    return float(total_norm)
