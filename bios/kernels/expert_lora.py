"""Routed experts' linear layers with per-expert LoRA, on rows grouped by adapter and expert.

A MoE layer's (token, expert) pairs arrive sorted into blocks, one per adapter in the batch plus one for rows
no adapter trains, and inside each block by expert. Each non-empty (block, expert) group then runs one matmul
with its expert's frozen weight and, when its block has an adapter, the two small matmuls of that expert's
LoRA: `x W_eᵀ + b_e + scale (x A_eᵀ) B_eᵀ`. `W + BA` is never formed, and the frozen weights get no gradient
work. Backward keeps only `x` and the rank-sized `x A_eᵀ`, like `bios.kernels.lora`.
"""

from __future__ import annotations

import torch

ExpertFactors = tuple[torch.Tensor, torch.Tensor, float]  # A [E, r, in], B [E, out, r], scale


def expert_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    counts: list[list[int]],
    factors: list[ExpertFactors | None],
    *,
    transposed: bool,
) -> torch.Tensor:
    """Rows of x [S, in] through their experts: rows are in blocks (`counts[b][e]` rows of expert e in block b,
    blocks in order, experts in order inside each); block b adds `factors[b]`'s LoRA when it is not None.

    `weight` is [E, out, in], or [E, in, out] when `transposed` (gpt-oss); `bias` [E, out] or None. The base
    weight and bias must be frozen; factors come back with gradients in their own dtype.
    """
    if len(counts) != len(factors):
        raise ValueError(f"expert_linear: {len(counts)} blocks of counts but {len(factors)} factor entries")
    if sum(map(sum, counts)) != x.shape[0]:
        raise ValueError(f"expert_linear: counts cover {sum(map(sum, counts))} rows, x has {x.shape[0]}")
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError("expert_linear: the experts' base weights must be frozen (LoRA trains only A and B)")
    lora = tuple(entry is not None for entry in factors)
    tensors = [t for entry in factors if entry is not None for t in entry[:2]]
    scales = tuple(float(entry[2]) for entry in factors if entry is not None)
    shape = tuple(tuple(block) for block in counts)
    return _ExpertLinear.apply(x, weight, bias, shape, lora, scales, transposed, *tensors)


def _groups(counts, lora):
    """(rows slice, expert, adapter index or None, offset inside the adapter's block) of every non-empty group."""
    row = 0
    adapter = 0
    for block, has_lora in zip(counts, lora):
        offset = 0
        for expert, n in enumerate(block):
            if n:
                yield slice(row, row + n), expert, (adapter if has_lora else None), slice(offset, offset + n)
            row += n
            offset += n
        adapter += has_lora


class _ExpertLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, counts, lora, scales, transposed, *factors):
        ctx.counts, ctx.lora, ctx.scales, ctx.transposed = counts, lora, scales, transposed
        ctx.factor_dtypes = [f.dtype for f in factors]
        lora_as = [f.to(x.dtype) for f in factors[0::2]]
        lora_bs = [f.to(x.dtype) for f in factors[1::2]]
        y = x.new_empty(x.shape[0], weight.shape[2] if transposed else weight.shape[1])
        block_rows = [sum(block) for block, has in zip(counts, lora) if has]
        xas = [x.new_empty(n, a.shape[1]) for n, a in zip(block_rows, lora_as)]
        for rows, expert, adapter, inside in _groups(counts, lora):
            w = weight[expert] if transposed else weight[expert].T
            torch.mm(x[rows], w, out=y[rows])
            if bias is not None:
                y[rows] += bias[expert]
            if adapter is not None:
                xa = torch.mm(x[rows], lora_as[adapter][expert].T, out=xas[adapter][inside])
                y[rows].addmm_(xa, lora_bs[adapter][expert].T, alpha=scales[adapter])
        ctx.save_for_backward(x, weight, *lora_as, *lora_bs, *xas)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        n = len(ctx.scales)
        x, weight, *rest = ctx.saved_tensors
        lora_as, lora_bs, xas = rest[:n], rest[n : 2 * n], rest[2 * n :]
        need_x = ctx.needs_input_grad[0]
        grad_x = torch.empty_like(x) if need_x else None
        grad_as = [torch.zeros_like(a) for a in lora_as]
        grad_bs = [torch.zeros_like(b) for b in lora_bs]
        for rows, expert, adapter, inside in _groups(ctx.counts, ctx.lora):
            g = grad_y[rows]
            if need_x:
                w = weight[expert].T if ctx.transposed else weight[expert]
                torch.mm(g, w, out=grad_x[rows])
            if adapter is None:
                continue
            scale = ctx.scales[adapter]
            g_b = g @ lora_bs[adapter][expert]
            if need_x:
                grad_x[rows].addmm_(g_b, lora_as[adapter][expert], alpha=scale)
            grad_as[adapter][expert].addmm_(g_b.T, x[rows], alpha=scale)
            grad_bs[adapter][expert].addmm_(g.T, xas[adapter][inside], alpha=scale)
        grads = [g for pair in zip(grad_as, grad_bs) for g in pair]
        grads = [g.to(dtype) for g, dtype in zip(grads, ctx.factor_dtypes)]
        return grad_x, None, None, None, None, None, None, *grads
