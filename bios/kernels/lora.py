"""LoRA linear layers with a hand-written backward, for one adapter or several adapters in one batch.

Stock autograd on `x W^T + b + s (x A^T) B^T` allocates the rank-r update and its scaled copy (both
output-sized) before adding them, and again in backward. Here the update is accumulated into the base output
in place, backward keeps only `x` and `x A^T` (rank-sized), and a frozen base weight gets no gradient work.
Scales ride on the GEMMs as alpha (no separate `mul_`), and in a `.backward()` into factors whose `.grad` is
preset (the worker's flat gradient buffer) each factor's gradient is added there by its GEMM (`grad_sink`)
rather than returned for autograd to add: one kernel where there were three, which is what a GPU's step,
bound by launches at this size, pays for.

Several adapters share a batch by owning contiguous row ranges ("segments") over dim 0 of `x`: the worker
batches whole sequences, so for `x [B, S, in]` a segment is a range of sequences, and for `x [T, in]` a range of
tokens. Each segment runs its own two small matmuls; no per-token weight copy is gathered.
"""

import math

import torch

from bios.kernels.frozen_matmul import frozen_input_grad, frozen_linear
from bios.kernels.grad_wanted import grad_wanted


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
    _check_inputs(x, weight, bias, lora_as, lora_bs, scales, segments)
    rows_per_item = math.prod(x.shape[1:-1])
    rows = x.reshape(-1, x.shape[-1])
    row_segments = tuple((start * rows_per_item, end * rows_per_item) for start, end in segments)
    factors = [t for pair in zip(lora_as, lora_bs) for t in pair]
    scales = tuple(float(s) for s in scales)
    if grad_wanted(rows, weight, bias, *factors):
        y = _LoraLinear.apply(rows, weight, bias, row_segments, scales, *factors)
    else:  # sampling, `forward`: the same ops without the Function's per-call cost
        y = _lora_linear_forward(rows, weight, bias, row_segments, scales, lora_as, lora_bs)[0]
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _lora_linear_forward(x, weight, bias, segments, scales, lora_as, lora_bs):
    """(y, each segment's x A^T, the factors in x's dtype)."""
    lora_as, lora_bs = [a.to(x.dtype) for a in lora_as], [b.to(x.dtype) for b in lora_bs]
    y = frozen_linear(x, weight, bias)
    xas = []
    for (start, end), a, b, scale in zip(segments, lora_as, lora_bs, scales):
        xa = x[start:end] @ a.T
        y[start:end].addmm_(xa, b.T, alpha=scale)
        xas.append(xa)
    return y, xas, lora_as, lora_bs


def _check_inputs(x, weight, bias, lora_as, lora_bs, scales, segments) -> None:
    if x.dim() < 2:
        raise ValueError(f"lora_linear_multi: x must be [D0, ..., in], got shape {tuple(x.shape)}")
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features:
        raise ValueError(f"lora_linear: x has {x.shape[-1]} features but weight is {tuple(weight.shape)}")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(
            f"lora_linear: x is {x.dtype} but weight/bias are {weight.dtype}/{None if bias is None else bias.dtype}; "
            "cast the base layer to the activation dtype"
        )
    if not len(lora_as) == len(lora_bs) == len(scales) == len(segments):
        raise ValueError(
            f"lora_linear_multi: need one lora_a, lora_b, scale and segment per adapter, got {len(lora_as)}, "
            f"{len(lora_bs)}, {len(scales)}, {len(segments)}"
        )
    for i, (a, b) in enumerate(zip(lora_as, lora_bs)):
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (out_features, a.shape[0]):
            raise ValueError(
                f"lora_linear: adapter {i} must be lora_a [r, {in_features}] and lora_b [{out_features}, r], got "
                f"{tuple(a.shape)} and {tuple(b.shape)}"
            )
    previous_end = 0
    for i, (start, end) in enumerate(segments):
        if not previous_end <= start <= end <= x.shape[0]:
            raise ValueError(
                f"lora_linear_multi: segment {i} = ({start}, {end}) must be sorted, disjoint and within "
                f"[0, {x.shape[0]}] (dim 0 of x); segments were {list(segments)}"
            )
        previous_end = end


def lora_b_grad(g: torch.Tensor, xa: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """scale gᵀ (x Aᵀ), [out, r] for g [rows, out] and xa [rows, r], as the transpose of (x Aᵀ)ᵀ g: a GEMM of r
    output rows runs ~1.4-1.8x faster than one of r output columns (512 rows by 1536 -> 16, AVX2: 159 vs 276 us;
    the head's 49152: 9 vs 16 ms). The scale is the GEMM's alpha (one op, not a product and a `mul_`)."""
    return scaled_mm(xa.T, g, scale).T


def add_b_grad(sink: torch.Tensor, g: torch.Tensor, xa: torch.Tensor, scale: float) -> None:
    """sink [out, r] += scale gᵀ (x Aᵀ): on CUDA one `addmm_` into it; on a CPU, where a GEMM of r output columns
    is the slow orientation (`lora_b_grad`), the fast product with the scale as alpha, then one `add_`."""
    if sink.is_cuda:
        sink.addmm_(g.T, xa, alpha=scale)
    else:
        sink.add_(lora_b_grad(g, xa, scale))


_ZEROS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def scaled_mm(left: torch.Tensor, right: torch.Tensor, scale: float) -> torch.Tensor:
    """scale · left @ right in one GEMM: `addmm` with beta 0 reads nothing of its input (not even NaNs), so a
    0-dim zero made once per device and dtype serves (broadcast inside the op, no view dispatched for it) and
    alpha carries the scale."""
    if scale == 1.0:
        return left @ right
    key = (left.device, left.dtype)
    zero = _ZEROS.get(key)
    if zero is None:
        zero = _ZEROS[key] = torch.zeros((), device=left.device, dtype=left.dtype)
    return torch.addmm(zero, left, right, beta=0, alpha=scale)


def grad_sink(ctx, edge: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The `.grad` of the leaf factor behind edge `edge` of the autograd Function `ctx` (its position among the
    Function's tensor inputs: arguments that are None or not tensors have no edge), when its backward may
    add the factor's gradient into it itself (one `addmm_` with the scale as alpha, where returning the gradient
    costs the product, its scaling and `AccumulateGrad`'s `add_`: ~3 kernels to 1 on every factor of every
    layer). Only where AccumulateGrad would do exactly that in place: the input is a leaf with a dense `.grad`
    of the gradient's dtype and shape, no tensor hooks, backward is not building a graph (`create_graph`), and
    this pass accumulates into leaves (`.backward()`, not `torch.autograd.grad`). None otherwise: the Function
    returns the gradient as usual. The worker presets every factor's `.grad` to a view of its flat gradient
    buffer (`AdapterState`, `factor_copies`), so its passes take the sink."""
    if torch.is_grad_enabled():
        return None
    node = ctx.next_functions[edge][0]
    factor = getattr(node, "variable", None)
    if factor is None or type(node).__name__ != "AccumulateGrad":
        return None
    grad = factor.grad
    if grad is None or grad.dtype != dtype or grad.shape != factor.shape or grad.layout != torch.strided \
            or factor._backward_hooks or factor._post_accumulate_grad_hooks:
        return None
    try:
        return grad if torch._C._will_engine_execute_node(node) else None
    except RuntimeError:  # `torch.autograd.grad`: it accumulates into no leaf (and torch asks not to be asked)
        return None


class _LoraLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, segments, scales, *factors):
        ctx.segments, ctx.scales = segments, scales
        ctx.first_factor_edge = 2 + (bias is not None)  # autograd's edges: the tensor inputs x, weight, bias?
        ctx.factor_dtypes = [f.dtype for f in factors]
        y, xas, lora_as, lora_bs = _lora_linear_forward(x, weight, bias, segments, scales, factors[0::2],
                                                        factors[1::2])
        needs = ctx.needs_input_grad
        keep_x = needs[1] or any(needs[5::2])
        keep_xa = any(needs[6::2])
        ctx.save_for_backward(x if keep_x else None, weight, *lora_as, *lora_bs, *(xas if keep_xa else ()))
        return y

    @staticmethod
    def backward(ctx, grad_y):
        n_adapters = len(ctx.segments)
        x, weight, *rest = ctx.saved_tensors
        lora_as, lora_bs, xas = rest[:n_adapters], rest[n_adapters : 2 * n_adapters], rest[2 * n_adapters :]
        need_x, need_w, need_bias = ctx.needs_input_grad[:3]
        grad_y = grad_y.reshape(-1, weight.shape[0])
        grad_x = frozen_input_grad(grad_y, weight) if need_x else None
        grad_w = grad_y.T @ x if need_w else None
        grad_bias = grad_y.sum(0) if need_bias else None
        grad_factors = []
        for i, ((start, end), scale) in enumerate(zip(ctx.segments, ctx.scales)):
            need_a, need_b = ctx.needs_input_grad[5 + 2 * i : 7 + 2 * i]
            g = grad_y[start:end]
            # d loss / d (x A^T) is scale * g B; the scale goes on the small [r, in] / [out, r] results instead, as
            # the GEMMs' alpha, and into the factors' .grad directly where autograd would only add it there
            g_b = g @ lora_bs[i] if need_x or need_a else None
            if need_x:
                grad_x[start:end].addmm_(g_b, lora_as[i], alpha=scale)
            sink_a = grad_sink(ctx, ctx.first_factor_edge + 2 * i, x.dtype) if need_a else None
            sink_b = grad_sink(ctx, ctx.first_factor_edge + 2 * i + 1, x.dtype) if need_b else None
            if sink_a is not None:
                sink_a.addmm_(g_b.T, x[start:end], alpha=scale)
            grad_factors.append(scaled_mm(g_b.T, x[start:end], scale) if need_a and sink_a is None else None)
            if sink_b is not None:
                add_b_grad(sink_b, g, xas[i], scale)
            grad_factors.append(lora_b_grad(g, xas[i], scale) if need_b and sink_b is None else None)
        grad_factors = [None if g is None else g.to(dtype) for g, dtype in zip(grad_factors, ctx.factor_dtypes)]
        return grad_x, grad_w, grad_bias, None, None, *grad_factors
