"""Routed experts' linear layers with per-expert LoRA, on rows grouped by adapter and expert.

A MoE layer's (token, expert) pairs arrive sorted into blocks, one per adapter in the batch plus one for rows
no adapter trains, and inside each block by expert. Each non-empty (block, expert) group then runs one matmul
with its expert's frozen weight and, when its block has an adapter, the two small matmuls of that expert's
LoRA: `x W_eᵀ + b_e + scale (x A_eᵀ) B_eᵀ`. `W + BA` is never formed, and the frozen weights get no gradient
work. Backward keeps only `x` and the rank-sized `x A_eᵀ`, like `bios.kernels.lora`. On CUDA, where every row
is 16-byte aligned, each block's three products run as torch grouped GEMMs instead of a loop over experts.

What a MoE layer keeps for backward is what bounds its training memory, so the rows a projection reads can be
described rather than formed: `rows` gathers them from the layer's tokens (the [tokens * top_k, hidden] sorted
copy is never made; backward adds each group's gradient into its tokens) and `activation` (the experts' gate)
is applied per group and recomputed in backward (neither its output nor autograd's intermediates are kept).
`combine_experts` weights and sums each token's expert outputs, keeping only those outputs and the weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bios.kernels.lora import grad_sink

ExpertFactors = tuple[torch.Tensor, torch.Tensor, float]  # A [E, r, in], B [E, out, r], scale


def expert_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    counts: list[list[int]],
    factors: list[ExpertFactors | None],
    *,
    transposed: bool,
    rows: torch.Tensor | None = None,
    activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Rows `activation(x[rows])` [S, in] through their experts: rows are in blocks (`counts[b][e]` rows of
    expert e in block b, blocks in order, experts in order inside each); block b adds `factors[b]`'s LoRA when
    it is not None. `rows` (int64 [S], default all of x in order) and `activation` (row-wise, default none)
    are applied one group at a time and again in backward, so only `x` is kept.

    `weight` is [E, out, in], or [E, in, out] when `transposed` (gpt-oss); `bias` [E, out] or None. The base
    weight and bias must be frozen; factors come back with gradients in their own dtype.
    """
    if len(counts) != len(factors):
        raise ValueError(f"expert_linear: {len(counts)} blocks of counts but {len(factors)} factor entries")
    num_rows = x.shape[0] if rows is None else rows.shape[0]
    if sum(map(sum, counts)) != num_rows:
        raise ValueError(f"expert_linear: counts cover {sum(map(sum, counts))} rows, the input has {num_rows}")
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError("expert_linear: the experts' base weights must be frozen (LoRA trains only A and B)")
    if _grouped_mm_applies(x, weight, factors):
        x = x if rows is None else x[rows]
        x = x if activation is None else activation(x)
        return _grouped_expert_linear(x, weight, bias, counts, factors, transposed=transposed)
    lora = tuple(entry is not None for entry in factors)
    tensors = [t for entry in factors if entry is not None for t in entry[:2]]
    scales = tuple(float(entry[2]) for entry in factors if entry is not None)
    shape = tuple(tuple(block) for block in counts)
    return _ExpertLinear.apply(x, rows, activation, weight, bias, shape, lora, scales, transposed, *tensors)


def _grouped_mm_applies(x: torch.Tensor, weight: torch.Tensor, factors: list[ExpertFactors | None]) -> bool:
    """Whether torch's grouped GEMM can run this: on CUDA, with every row stride a multiple of 16 bytes."""
    if not x.is_cuda or not hasattr(torch.nn.functional, "grouped_mm"):
        return False
    if torch.cuda.get_device_capability(x.device) < (8, 0):
        return False
    align = 16 // x.element_size()
    dims = [*weight.shape[1:], *(entry[0].shape[1] for entry in factors if entry is not None)]
    return all(dim % align == 0 for dim in dims)


def _grouped_expert_linear(x, weight, bias, counts, factors, *, transposed):
    """`expert_linear` through `torch.nn.functional.grouped_mm` (one GEMM per block and matrix, autograd's
    backward), for CUDA; the same arithmetic as the loop."""
    grouped_mm = torch.nn.functional.grouped_mm
    weight_t = weight if transposed else weight.transpose(1, 2)  # [E, in, out]
    pieces = []
    start = 0
    for block, entry in zip(counts, factors):
        rows = sum(block)
        if not rows:
            continue
        xs = x[start : start + rows]
        offsets = torch.tensor(block, device=x.device).cumsum(0).to(torch.int32)
        y = grouped_mm(xs, weight_t, offs=offsets)
        if bias is not None:
            experts = torch.repeat_interleave(torch.arange(len(block), device=x.device), torch.tensor(block, device=x.device))
            y = y + bias[experts]
        if entry is not None:
            lora_a, lora_b, scale = entry
            xa = grouped_mm(xs, lora_a.to(x.dtype).transpose(1, 2), offs=offsets)
            y = y + scale * grouped_mm(xa, lora_b.to(x.dtype).transpose(1, 2), offs=offsets)
        pieces.append(y)
        start += rows
    if not pieces:
        return x.new_zeros(0, weight_t.shape[2])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def expert_groups(counts: list[list[int]], lora: list[bool]):
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


def _group_input(x, rows, activation, group, *, need_grad=False):
    """(the picked rows, the input) of one group: `x[group]` or gathered through `rows`, then through
    `activation`; with `need_grad`, the activation runs on picked rows requiring grad (for its VJP)."""
    picked = x[group] if rows is None else x.index_select(0, rows[group])
    if activation is None:
        return picked, picked
    if not need_grad:
        return picked, activation(picked)
    with torch.enable_grad():
        picked = picked.detach().requires_grad_()
        return picked, activation(picked)


class _ExpertLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rows, activation, weight, bias, counts, lora, scales, transposed, *factors):
        ctx.activation, ctx.counts, ctx.lora, ctx.scales, ctx.transposed = activation, counts, lora, scales, transposed
        ctx.factor_dtypes = [f.dtype for f in factors]
        # autograd's edges: the tensor inputs x, rows?, weight, bias? (grad_sink)
        ctx.first_factor_edge = 2 + (rows is not None) + (bias is not None)
        lora_as = [f.to(x.dtype) for f in factors[0::2]]
        lora_bs = [f.to(x.dtype) for f in factors[1::2]]
        num_rows = x.shape[0] if rows is None else rows.shape[0]
        y = x.new_empty(num_rows, weight.shape[2] if transposed else weight.shape[1])
        block_rows = [sum(block) for block, has in zip(counts, lora) if has]
        xas = [x.new_empty(n, a.shape[1]) for n, a in zip(block_rows, lora_as)]
        for group, expert, adapter, inside in expert_groups(counts, lora):
            _, xg = _group_input(x, rows, activation, group)
            w = weight[expert] if transposed else weight[expert].T
            torch.mm(xg, w, out=y[group])
            if bias is not None:
                y[group] += bias[expert]
            if adapter is not None:
                xa = torch.mm(xg, lora_as[adapter][expert].T, out=xas[adapter][inside])
                y[group].addmm_(xa, lora_bs[adapter][expert].T, alpha=scales[adapter])
        ctx.save_for_backward(x, rows, weight, *lora_as, *lora_bs, *xas)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        n = len(ctx.scales)
        x, rows, weight, *rest = ctx.saved_tensors
        lora_as, lora_bs, xas = rest[:n], rest[n : 2 * n], rest[2 * n :]
        activation = ctx.activation
        need_x = ctx.needs_input_grad[0]
        grad_x = None
        if need_x:  # every row of x is some group's unless `rows` picks them (and may pick one twice)
            grad_x = torch.empty_like(x) if rows is None else torch.zeros_like(x)
        # each factor's gradient straight into its preset .grad where autograd would only add it there, else
        # into zeros that are returned
        sinks = [grad_sink(ctx, ctx.first_factor_edge + i, x.dtype) for i in range(2 * n)]
        grad_as = [torch.zeros_like(a) if sink is None else sink for a, sink in zip(lora_as, sinks[0::2])]
        grad_bs = [torch.zeros_like(b) if sink is None else sink for b, sink in zip(lora_bs, sinks[1::2])]
        direct = rows is None and activation is None  # each group's input gradient is a slice of grad_x
        for group, expert, adapter, inside in expert_groups(ctx.counts, ctx.lora):
            if adapter is None and not need_x:
                continue
            g = grad_y[group]
            picked, xg = _group_input(x, rows, activation, group, need_grad=need_x)
            if need_x:
                w = weight[expert].T if ctx.transposed else weight[expert]
                grad_xg = torch.mm(g, w, out=grad_x[group]) if direct else g @ w
            if adapter is not None:
                scale = ctx.scales[adapter]
                g_b = g @ lora_bs[adapter][expert]
                if need_x:
                    grad_xg.addmm_(g_b, lora_as[adapter][expert], alpha=scale)
                grad_as[adapter][expert].addmm_(g_b.T, xg, alpha=scale)
                grad_bs[adapter][expert].addmm_(g.T, xas[adapter][inside], alpha=scale)
            if need_x and not direct:
                if activation is not None:
                    (grad_xg,) = torch.autograd.grad(xg, picked, grad_xg)
                if rows is None:
                    grad_x[group] = grad_xg
                else:
                    grad_x.index_add_(0, rows[group], grad_xg)
        grads = [g for pair in zip(grad_as, grad_bs) for g in pair]
        grads = [None if sink is not None else g.to(dtype) for g, sink, dtype in zip(grads, sinks, ctx.factor_dtypes)]
        return grad_x, None, None, None, None, None, None, None, None, *grads


def combine_experts(out: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, top_k: int,
                    tokens: int) -> torch.Tensor:
    """Each token's routing-weighted sum of its expert outputs: sorted row i of `out` [S, hidden] is the
    (token, expert) pair `order[i]` (token `order[i] // top_k`) with routing weight `weights[i]`; returns
    [tokens, hidden], summed over each token's pairs in pair order as transformers does. Pairs missing from
    `order` (routed to experts another worker holds) add nothing. Backward keeps `out` and `weights` (autograd
    through the stock ops also keeps their product, for the unsort)."""
    if not out.shape[0] == weights.shape[0] == order.shape[0] or out.shape[0] > tokens * top_k:
        raise ValueError(
            f"combine_experts: out {tuple(out.shape)}, weights {tuple(weights.shape)} and order "
            f"{tuple(order.shape)} must have the same rows, at most tokens * top_k = {tokens * top_k}"
        )
    return _CombineExperts.apply(out, weights, order, top_k, tokens)


class _CombineExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, weights, order, top_k, tokens):
        ctx.top_k = top_k
        ctx.save_for_backward(out, weights, order)
        unsorted = out.new_zeros(tokens * top_k, out.shape[1]).index_copy_(0, order, out * weights[:, None])
        return unsorted.view(tokens, top_k, -1).sum(dim=1)

    @staticmethod
    def backward(ctx, grad):
        out, weights, order = ctx.saved_tensors
        grad_rows = grad.index_select(0, order // ctx.top_k)
        grad_weights = (grad_rows * out).sum(dim=1) if ctx.needs_input_grad[1] else None
        grad_out = grad_rows.mul_(weights[:, None]) if ctx.needs_input_grad[0] else None
        return grad_out, grad_weights, None, None, None
