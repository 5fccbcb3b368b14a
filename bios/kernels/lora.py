"""LoRA linear layers with a hand-written backward, for one adapter or several adapters in one batch.

Stock autograd on `x W^T + b + s (x A^T) B^T` allocates the rank-r update and its scaled copy (both
output-sized) before adding them, and again in backward. Here the update is accumulated into the base output
in place, backward keeps only `x` and `x A^T` (rank-sized), and a frozen base weight gets no gradient work.

Several adapters share a batch by owning contiguous row ranges ("segments") over dim 0 of `x`: the worker
batches whole sequences, so for `x [B, S, in]` a segment is a range of sequences, and for `x [T, in]` a range of
tokens. Each segment runs its own two small matmuls; no per-token weight copy is gathered.
"""

import itertools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """x W^T + b + scale * (x A^T) B^T for x [..., in], weight [out, in], lora_a [r, in], lora_b [out, r]."""
    if x.dim() == 0:
        raise ValueError("lora_linear: x must have at least one dimension [..., in]")
    rows = x.reshape(-1, x.shape[-1])
    y = lora_linear_multi(rows, weight, bias, [lora_a], [lora_b], [scale], [(0, rows.shape[0])])
    return y.reshape(*x.shape[:-1], weight.shape[0])


def lora_linear_multi(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_as: list[torch.Tensor],
    lora_bs: list[torch.Tensor],
    scales: list[float],
    segments: list[tuple[int, int]],
) -> torch.Tensor:
    """Base linear on every row of x [D0, ..., in]; rows x[start:end] (over dim 0) also get adapter i.

    Segments must be sorted and disjoint; rows outside every segment get the base output only. Adapters may
    have different ranks. Factors are used in x's dtype; their gradients come back in their own dtype.
    """
    if not len(lora_as) == len(lora_bs) == len(scales) == len(segments):
        raise ValueError(
            f"lora_linear_multi: need one lora_a, lora_b, scale and segment per adapter, got {len(lora_as)}, "
            f"{len(lora_bs)}, {len(scales)}, {len(segments)}"
        )
    blocks = [BlockSegment(start, end, scale, ((0, a, b),))
              for (start, end), a, b, scale in zip(segments, lora_as, lora_bs, scales)]
    return lora_linear_blocks(x, weight, bias, [weight.shape[0]], blocks)[0]


class BlockSegment(NamedTuple):
    """Rows [start, end) over dim 0 of x get, on each listed output block, `scale * (x Aᵀ) Bᵀ`."""

    start: int
    end: int
    scale: float
    factors: tuple[tuple[int, torch.Tensor, torch.Tensor], ...]  # (block, lora_a [r, in], lora_b [size, r]), blocks rising


def lora_linear_blocks(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    sizes: list[int],
    segments: list[BlockSegment],
) -> tuple[torch.Tensor, ...]:
    """Several linear layers that read the same x [D0, ..., in], as one: `weight` [sum(sizes), in] (and `bias`)
    stack the layers' weights; one output [D0, ..., size] per layer (views of one GEMM's result).

    Projections such as q/k/v or gate/up then cost one frozen GEMM each way instead of one per layer, and a
    segment's LoRA factors of several layers share one `x [A_1; A_2; ...]ᵀ` product (x is read once).
    Segments must be sorted and disjoint, as in `lora_linear_multi`.
    """
    _check_inputs(x, weight, bias, sizes, segments)
    rows_per_item = math.prod(x.shape[1:-1])
    rows = x.reshape(-1, x.shape[-1])
    plan = tuple(
        (segment.start * rows_per_item, segment.end * rows_per_item, float(segment.scale),
         tuple(block for block, _, _ in segment.factors))
        for segment in segments
    )
    factors = [t for segment in segments for _, a, b in segment.factors for t in (a, b)]
    outputs = _LoraLinear.apply(rows, weight, bias, tuple(sizes), plan, *factors)
    return tuple(y.reshape(*x.shape[:-1], y.shape[-1]) for y in outputs)


def _check_inputs(x, weight, bias, sizes, segments) -> None:
    if x.dim() < 2:
        raise ValueError(f"lora_linear_multi: x must be [D0, ..., in], got shape {tuple(x.shape)}")
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features:
        raise ValueError(f"lora_linear: x has {x.shape[-1]} features but weight is {tuple(weight.shape)}")
    if sum(sizes) != out_features or min(sizes) < 1:
        raise ValueError(f"lora_linear_blocks: block sizes {list(sizes)} must be positive and add up to the "
                         f"weight's {out_features} output features")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(
            f"lora_linear: x is {x.dtype} but weight/bias are {weight.dtype}/{None if bias is None else bias.dtype}; "
            "cast the base layer to the activation dtype"
        )
    for i, segment in enumerate(segments):
        blocks = [block for block, _, _ in segment.factors]
        if blocks != sorted(set(blocks)) or not all(0 <= block < len(sizes) for block in blocks):
            raise ValueError(f"lora_linear_blocks: segment {i} names blocks {blocks}; they must rise within "
                             f"[0, {len(sizes)})")
        for block, a, b in segment.factors:
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (sizes[block], a.shape[0]):
                raise ValueError(
                    f"lora_linear: adapter {i} must be lora_a [r, {in_features}] and lora_b [{sizes[block]}, r], "
                    f"got {tuple(a.shape)} and {tuple(b.shape)}"
                )
    previous_end = 0
    for i, segment in enumerate(segments):
        if not previous_end <= segment.start <= segment.end <= x.shape[0]:
            raise ValueError(
                f"lora_linear_multi: segment {i} = ({segment.start}, {segment.end}) must be sorted, disjoint and "
                f"within [0, {x.shape[0]}] (dim 0 of x); segments were {[(s.start, s.end) for s in segments]}"
            )
        previous_end = segment.end


def _stacked(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim)


class _LoraLinear(torch.autograd.Function):
    """Forward and backward of `lora_linear_blocks` over 2D rows; `plan` holds each segment's (start, end,
    scale, blocks) and `factors` its (A, B) pairs, block by block, segment after segment."""

    @staticmethod
    def forward(ctx, x, weight, bias, sizes, plan, *factors):
        ctx.sizes, ctx.plan = sizes, plan
        ctx.factor_dtypes = [f.dtype for f in factors]
        factors = [f.to(x.dtype) for f in factors]
        offsets = [0, *itertools.accumulate(sizes)]
        y = F.linear(x, weight, bias)
        stacked_as, xas = [], []
        pairs = iter(zip(factors[0::2], factors[1::2]))
        for start, end, scale, blocks in plan:
            segment_pairs = [next(pairs) for _ in blocks]
            lora_a = _stacked([a for a, _ in segment_pairs], 0)  # [A_1; A_2; ...]: x is read once
            xa = x[start:end] @ lora_a.T
            rank_start = 0
            for block, (a, b) in zip(blocks, segment_pairs):
                columns = slice(offsets[block], offsets[block + 1])
                y[start:end, columns].addmm_(xa[:, rank_start : rank_start + a.shape[0]], b.T, alpha=scale)
                rank_start += a.shape[0]
            stacked_as.append(lora_a)
            xas.append(xa)
        needs = ctx.needs_input_grad
        keep_x = needs[1] or any(needs[5::2])
        keep_xa = any(needs[6::2])
        ctx.save_for_backward(x if keep_x else None, weight, *stacked_as, *factors[1::2], *(xas if keep_xa else ()))
        ctx.ranks = [a.shape[0] for a in factors[0::2]]
        return y.split(list(sizes), dim=1) if len(sizes) > 1 else (y,)  # one block: y itself, as ever

    @staticmethod
    def backward(ctx, *grad_outputs):
        n_segments = len(ctx.plan)
        x, weight, *rest = ctx.saved_tensors
        stacked_as, rest = rest[:n_segments], rest[n_segments:]
        n_pairs = len(ctx.ranks)
        lora_bs, xas = rest[:n_pairs], rest[n_pairs:]
        need_x, need_w, need_bias = ctx.needs_input_grad[:3]
        grad_y = _stacked([g if g is not None else torch.zeros(g_shape, dtype=weight.dtype, device=weight.device)
                           for g, g_shape in zip(grad_outputs, _shapes(grad_outputs, ctx.sizes))], 1)
        offsets = [0, *itertools.accumulate(ctx.sizes)]
        grad_x = grad_y @ weight if need_x else None
        grad_w = grad_y.T @ x if need_w else None
        grad_bias = grad_y.sum(0) if need_bias else None
        grad_factors = []
        pair = 0
        for i, (start, end, scale, blocks) in enumerate(ctx.plan):
            g = grad_y[start:end]
            columns = [slice(offsets[block], offsets[block + 1]) for block in blocks]
            pairs = range(pair, pair + len(blocks))
            need_a = any(ctx.needs_input_grad[5 + 2 * p] for p in pairs)
            # d loss / d (x A^T) is scale * g B; the scale goes on the small [r, in] / [out, r] results instead
            g_b = _stacked([g[:, c] @ lora_bs[p] for c, p in zip(columns, pairs)], 1) if need_x or need_a else None
            if need_x:
                grad_x[start:end].addmm_(g_b, stacked_as[i], alpha=scale)
            grad_as = (g_b.T @ x[start:end]).mul_(scale).split([ctx.ranks[p] for p in pairs]) if need_a else None
            rank_start = 0
            for j, (c, p) in enumerate(zip(columns, pairs)):
                grad_factors.append(None if grad_as is None else grad_as[j])
                xa = xas[i][:, rank_start : rank_start + ctx.ranks[p]] if xas else None
                grad_factors.append((g[:, c].T @ xa).mul_(scale) if ctx.needs_input_grad[6 + 2 * p] else None)
                rank_start += ctx.ranks[p]
            pair += len(blocks)
        grad_factors = [None if g is None else g.to(dtype) for g, dtype in zip(grad_factors, ctx.factor_dtypes)]
        return grad_x, grad_w, grad_bias, None, None, *grad_factors


def _shapes(grad_outputs, sizes):
    """The [rows, size] shape of each block's gradient (for blocks autograd gave no gradient)."""
    rows = next(g.shape[0] for g in grad_outputs if g is not None)
    return [(rows, size) for size in sizes]
