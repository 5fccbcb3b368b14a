"""LoRA layers that multiply the same input (a Llama layer's q, k and v; its gate and up) computed as one layer.

Their frozen weights, laid out one after another in one tensor (`end_to_end`), multiply x in one product; each
adapter's A factors of those layers, stacked, make one `x [A_q; A_k; A_v]ᵀ`; in backward one product gives the
input's gradient through all the weights and one more through all of an adapter's A factors, and one gives the
stacked A factors' gradients. Fewer and wider products: the separate layers' rank-16 products ran at 60-130
GFLOP/s on a 2-core AVX2 CPU against ~200 for the frozen ones, and each layer costs a GPU a dozen launches.
The arithmetic is `lora_linear_multi`'s for each layer, to fp32 rounding (wider products sum in other orders),
with its scales as GEMM alphas and its factors' gradients added into a preset `.grad` by the GEMMs (`grad_sink`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import Tensor

from bios.kernels.frozen_matmul import frozen_input_grad, frozen_linear
from bios.kernels.grad_wanted import grad_wanted
from bios.kernels.lora import add_b_grad, grad_sink, lora_b_grad, scaled_mm


def end_to_end(tensors: list[Tensor]) -> Tensor | None:
    """The tensors (weights [out_i, in] or biases [out_i]) as one [sum of out_i, ...] view, when they lie one after
    another in one storage, contiguous and of one dtype; None otherwise (each was made on its own, or
    re-made since: a tensor-parallel shard, a move to another device)."""
    first = tensors[0]
    if not all(t.is_contiguous() and t.dtype == first.dtype and t.device == first.device
               and t.shape[1:] == first.shape[1:] for t in tensors):
        return None
    storage = first.untyped_storage().data_ptr()
    for previous, tensor in zip(tensors, tensors[1:]):
        if tensor.untyped_storage().data_ptr() != storage or \
                tensor.storage_offset() != previous.storage_offset() + previous.numel():
            return None
    rows = sum(t.shape[0] for t in tensors)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


@dataclass(frozen=True)
class AdapterRows:
    """Rows [start, end) of x (over dim 0) use one adapter in the layers `members` (indices into the stacked
    layers, ascending): its A factors [r_i, in] and B factors [out_i, r_i] there, and its scale."""

    start: int
    end: int
    members: tuple[int, ...]
    lora_as: tuple[Tensor, ...]
    lora_bs: tuple[Tensor, ...]
    scale: float


def stacked_lora_linear(x: Tensor, weight: Tensor, bias: Tensor | None, outs: tuple[int, ...],
                        adapters: list[AdapterRows]) -> Tensor:
    """The stacked layers' outputs side by side, [..., sum of outs], for x [D0, ..., in]: `x Wᵀ + b` by the
    frozen weights end to end (weight [sum of outs, in]) plus, on each adapter's rows, each member layer's
    `scale (x Aᵢᵀ) Bᵢᵀ` in its columns. Adapters' row ranges must be sorted and disjoint."""
    if weight.shape[0] != sum(outs) or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"stacked_lora_linear: x [..., {x.shape[-1]}] and weight {tuple(weight.shape)} do not "
                         f"stack layers of {outs} outputs")
    rows_per_item = math.prod(x.shape[1:-1])
    rows = x.reshape(-1, x.shape[-1])
    plan = tuple((a.start * rows_per_item, a.end * rows_per_item, a.members, a.scale) for a in adapters)
    factors = [t for a in adapters for t in (*a.lora_as, *a.lora_bs)]
    if grad_wanted(rows, *factors):
        y = _StackedLoraLinear.apply(rows, weight, bias, outs, plan, *factors)
    else:  # a forward pass: the same ops without the Function's per-call cost
        y = _stacked_forward(rows, weight, bias, _columns(outs), plan, factors)[0]
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _columns(outs: tuple[int, ...]) -> list[slice]:
    offsets = [0, *accumulate(outs)]
    return [slice(start, end) for start, end in zip(offsets, offsets[1:])]


def _unflatten(plan, factors):
    """Each adapter's (A factors, B factors) from the flat list the Function was given."""
    pairs, i = [], 0
    for *_, members, _ in plan:
        n = len(members)
        pairs.append((factors[i : i + n], factors[i + n : i + 2 * n]))
        i += 2 * n
    return pairs


def _stacked_forward(x, weight, bias, columns, plan, factors):
    """(y, each adapter's stacked A factors, every B factor, each adapter's x Aᵀ), factors in x's dtype."""
    y = frozen_linear(x, weight, bias)
    stacked_as, lora_bs, xas = [], [], []
    for (start, end, members, scale), (a_factors, b_factors) in zip(plan, _unflatten(plan, factors)):
        a = torch.cat([f.to(x.dtype) for f in a_factors]) if len(a_factors) > 1 else a_factors[0].to(x.dtype)
        bs = [f.to(x.dtype) for f in b_factors]
        xa = x[start:end] @ a.T
        rank_start = 0
        for member, b in zip(members, bs):
            rank = b.shape[1]
            y[start:end, columns[member]].addmm_(xa[:, rank_start : rank_start + rank], b.T, alpha=scale)
            rank_start += rank
        stacked_as.append(a)
        lora_bs.extend(bs)
        xas.append(xa)
    return y, stacked_as, lora_bs, xas


class _StackedLoraLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, outs, plan, *factors):
        y, stacked_as, lora_bs, xas = _stacked_forward(x, weight, bias, _columns(outs), plan, factors)
        ctx.outs, ctx.plan = outs, plan
        ctx.first_factor_edge = 2 + (bias is not None)  # autograd's edges: the tensor inputs x, weight, bias?
        ctx.factor_dtypes = [f.dtype for f in factors]
        ctx.save_for_backward(x, weight, *stacked_as, *lora_bs, *xas)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        plan, columns = ctx.plan, _columns(ctx.outs)
        x, weight, *rest = ctx.saved_tensors
        n_b = sum(len(members) for *_, members, _ in plan)
        stacked_as, lora_bs, xas = rest[: len(plan)], rest[len(plan) : len(plan) + n_b], rest[len(plan) + n_b :]
        need_x = ctx.needs_input_grad[0]
        grad_x = frozen_input_grad(grad_y, weight) if need_x else None
        grad_factors, b_index, edge = [], 0, ctx.first_factor_edge  # edge: the adapter's first factor's (grad_sink)
        for (start, end, members, scale), a, xa in zip(plan, stacked_as, xas):
            g = grad_y[start:end]
            n = len(members)
            bs = lora_bs[b_index : b_index + n]
            b_index += n
            # d loss / d (x Aᵀ) is scale·g·B per layer; the scale goes on the small results as the GEMMs' alpha, and
            # into the factors' .grad directly where autograd would only add it there (`grad_sink`)
            ranks = [b.shape[1] for b in bs]
            rank_starts = [0, *accumulate(ranks)]
            if n > 1:  # each layer's g·B straight into its columns of one buffer (no cat)
                g_b = g.new_empty(g.shape[0], rank_starts[-1])
                for m, b, r0, r1 in zip(members, bs, rank_starts, rank_starts[1:]):
                    torch.mm(g[:, columns[m]], b, out=g_b[:, r0:r1])
            else:
                g_b = g[:, columns[members[0]]] @ bs[0]
            if need_x:
                grad_x[start:end].addmm_(g_b, a, alpha=scale)
            sinks = [grad_sink(ctx, edge + k, x.dtype) for k in range(2 * n)]
            edge += 2 * n
            joined = end_to_end(sinks[:n]) if n > 1 and all(sink is not None for sink in sinks[:n]) else None
            if joined is not None:  # the A factors' .grad lie end to end: the stacked product straight into them
                joined.addmm_(g_b.T, x[start:end], alpha=scale)
                grad_factors.extend([None] * n)
            elif all(sink is not None for sink in sinks[:n]):
                # each A's gradient straight into its .grad: its r rows of the stacked product, one addmm_ each
                for sink, r0, r1 in zip(sinks[:n], rank_starts, rank_starts[1:]):
                    sink.addmm_(g_b[:, r0:r1].T, x[start:end], alpha=scale)
                grad_factors.extend([None] * n)
            else:
                grad_factors.extend(scaled_mm(g_b.T, x[start:end], scale).split(ranks))
            for sink, m, r0, r1 in zip(sinks[n:], members, rank_starts, rank_starts[1:]):
                if sink is None:
                    grad_factors.append(lora_b_grad(g[:, columns[m]], xa[:, r0:r1], scale))
                else:
                    add_b_grad(sink, g[:, columns[m]], xa[:, r0:r1], scale)
                    grad_factors.append(None)
        grad_factors = [g.to(dtype) if need and g is not None else None
                        for g, dtype, need in zip(grad_factors, ctx.factor_dtypes, ctx.needs_input_grad[5:])]
        return grad_x, None, None, None, None, *grad_factors
