"""A training pass's attention on CPU where each query sees one interval of keys, computing only those pairs.

PyTorch's CPU flash attention multiplies every query by every key of a row of up to 512 and masks the causal half
afterwards: with `is_causal` it takes as long as without (SmolLM2's 4 rows x 128 positions, 9 query heads over 3
kv heads: 3.7-4.0 ms a layer forward and backward either way, AVX2 code, 2 threads). A causal row, a row of
packed sequences (each query sees its own sequence up to itself), a sliding window and a right-padded row all
give each query one interval of keys, `lo[b, i]..hi[b, i]` (or none: a left pad's query, whose output is zeros);
`csrc/training_attention.c` multiplies a block of queries only by the keys their intervals span and writes the
output in the [batch, position, head, dim] layout the output projection reads: 2.8-2.9 ms for that layer.
`stacked_attention` takes a stacked q/k/v projection output as it is and RoPE's its queries and keys in the
kernel, forward and backward, so the rotation, the split into q, k, v and the concatenation of their gradients
are no passes of their own: 3.0-3.2 ms against 4.0-4.4 for the rotary kernel then `interval_attention`. Forward and
backward agree with SDPA (and Transformers' RoPE) in float64 to fp32 rounding (`tests/test_interval_attention.py`).

`key_intervals` reads the intervals off what Transformers hands an attention function (no mask and a causal
module, or a boolean mask whose every row is one interval or empty); `suits` says whether the kernel takes the
tensors (CPU, a head width the kernel's tiles divide, as many keys as queries, the C kernels built).
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from bios.kernels import rotary
from bios.kernels.c_kernels import c_kernels

# The last mask's intervals: a pass hands every layer the same mask, so they are read off it once a pass.
# (mask reference, its version, intervals); tensors compare elementwise, so the key is held by identity.
_last_mask: tuple[weakref.ref, int, tuple[Tensor, Tensor] | None] | None = None


def suits(query: Tensor, key: Tensor, value: Tensor, *, same_length: bool = True) -> bool:
    """Whether `interval_attention` takes these [B, H, S, D] tensors: CPU, queries and keys of one length (unless
    not `same_length`: queries at some of the keys' positions, their intervals saying which), keys and values of
    one width, a head width the kernel's tiles divide, whole groups of query heads per kv head, and the C kernels
    built (`BIOS_C_KERNELS` not off)."""
    if query.device.type != "cpu" or query.dim() != 4 or key.shape != value.shape:
        return False
    batch, heads, length, width = query.shape
    if key.shape[0] != batch or (same_length and key.shape[2] != length) or key.shape[3] != width \
            or heads % key.shape[1]:
        return False
    kernels = c_kernels()
    return kernels is not None and width % (2 * kernels.width) == 0


def key_intervals(attention_mask: Tensor | None, causal: bool, batch: int, length: int) -> tuple[Tensor, Tensor] | None:
    """(lo, hi), int32 [batch, length]: query i of batch row b sees keys lo[b, i]..hi[b, i] (none where hi < lo:
    its output is zeros, as SDPA's). From no mask (causal or full rows), or a boolean [batch or 1, 1, length,
    length] mask (True attends) whose every row is one interval or empty; None for anything else (a float mask,
    gaps)."""
    if attention_mask is None:
        positions = torch.arange(length, dtype=torch.int32)
        hi = positions if causal else torch.full((length,), length - 1, dtype=torch.int32)
        return torch.zeros(batch, length, dtype=torch.int32), hi.expand(batch, length).contiguous()
    if attention_mask.dtype != torch.bool or attention_mask.dim() != 4 or attention_mask.shape[1] != 1 \
            or attention_mask.shape[0] not in (1, batch) or tuple(attention_mask.shape[2:]) != (length, length):
        return None
    if attention_mask.is_inference():  # no version counter to tell an edit by: read afresh
        intervals = _intervals_of(attention_mask[:, 0].cpu())
    else:
        global _last_mask
        cached = _last_mask  # one read: another thread may replace it meanwhile
        if cached is None or cached[0]() is not attention_mask or cached[1] != attention_mask._version:
            cached = (weakref.ref(attention_mask), attention_mask._version, _intervals_of(attention_mask[:, 0].cpu()))
            _last_mask = cached
        intervals = cached[2]
    if intervals is None:
        return None
    lo, hi = intervals
    return lo.expand(batch, length).contiguous(), hi.expand(batch, length).contiguous()


def _intervals_of(mask: Tensor) -> tuple[Tensor, Tensor] | None:
    """Each row's first and last True key of mask [B, L, L] (a row without one, a left pad's: 0 and -1), if every
    row's Trues are one run."""
    length = mask.shape[-1]
    counts = mask.sum(-1, dtype=torch.int32)
    as_int = mask.to(torch.int8)
    seen = counts > 0
    lo = torch.where(seen, as_int.argmax(-1).to(torch.int32), 0)
    hi = torch.where(seen, (length - 1 - as_int.flip(-1).argmax(-1)).to(torch.int32), -1)
    return (lo, hi) if bool((hi - lo + 1 == counts).all()) else None


def interval_attention(query: Tensor, key: Tensor, value: Tensor, lo: Tensor, hi: Tensor, scale: float) -> Tensor:
    """softmax(scale q kᵀ over each query's interval) v for fp32 query [B, Hq, S, D] and key, value
    [B, Hkv, Sk, D] (any strides with D contiguous; `suits` must hold), returned as [B, S, Hq, D] (contiguous),
    the layout Transformers' attention functions return. Differentiable in query, key and value."""
    _check(query, lo, hi, (query, key, value))
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return _IntervalAttention.apply(query, key, value, lo, hi, scale)
    return _forward(*(_by_position(t) for t in (query, key, value)), lo, hi, scale, None)[0]


def stacked_attention(qkv: Tensor, heads: int, kv_heads: int, lo: Tensor, hi: Tensor, scale: float,
                      cos: Tensor | None = None, sin: Tensor | None = None) -> Tensor:
    """`interval_attention` of a stacked q/k/v projection output qkv [B, S, (heads + 2 kv_heads) x D] (fp32, the
    last dim contiguous), its queries and keys RoPE'd by Transformers' cos and sin tables [B or 1, S, D] on the way
    into the kernel: [B, S, heads x D]. Its gradient comes back as one tensor like qkv, so nothing is rotated,
    split or concatenated outside the kernel, forward or backward."""
    width = qkv.shape[-1] // (heads + 2 * kv_heads)
    query, key, value = split_stacked(qkv, heads, kv_heads)
    _check(query.transpose(1, 2), lo, hi, (qkv,))
    if cos is not None:  # the kernel reads fp32 tables, a row per batch row and position
        if not rope_tables_fit(qkv, width, cos, sin):
            raise ValueError(f"stacked_attention: cos and sin must be [{qkv.shape[0]} or 1, {qkv.shape[1]}, {width}] "
                             f"for qkv {tuple(qkv.shape)}, got {tuple(cos.shape)} and {tuple(sin.shape)}")
        cos, sin = (t.to(torch.float32).expand(qkv.shape[0], -1, -1) for t in (cos, rotary.signed_sin(sin)))
        cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
    if torch.is_grad_enabled() and qkv.requires_grad:
        out = _StackedAttention.apply(qkv, heads, kv_heads, lo, hi, scale, cos, sin)
    else:
        out = _forward(query, key, value, lo, hi, scale, (cos, sin) if cos is not None else None)[0]
    return out.view(*qkv.shape[:-1], heads * width)


def rope_tables_fit(qkv: Tensor, width: int, cos: Tensor, sin: Tensor) -> bool:
    """Whether cos and sin are RoPE tables the kernel can read for qkv [B, S, ...] with heads `width` wide:
    [B or 1, S, width] each."""
    return cos.shape == sin.shape and cos.dim() == 3 and cos.shape[0] in (1, qkv.shape[0]) \
        and cos.shape[1:] == (qkv.shape[1], width)


def split_stacked(qkv: Tensor, heads: int, kv_heads: int) -> list[Tensor]:
    """q, k, v of a stacked projection output [B, S, (heads + 2 kv_heads) x D] as [B, S, H, D] views."""
    width = qkv.shape[-1] // (heads + 2 * kv_heads)
    parts = qkv.split([heads * width, kv_heads * width, kv_heads * width], dim=-1)
    return [part.unflatten(-1, (-1, width)) for part in parts]


def _check(query: Tensor, lo: Tensor, hi: Tensor, tensors: tuple[Tensor, ...]) -> None:
    """What the kernel reads without checking: fp32 CPU tensors, int32 intervals [B, S] of the query [B, H, S, D]."""
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        raise TypeError("interval attention takes fp32 CPU tensors, got "
                        + ", ".join(f"{t.dtype} on {t.device}" for t in tensors))
    expected = (query.shape[0], query.shape[2])
    if any(t.dtype != torch.int32 or tuple(t.shape) != expected or not t.is_contiguous() for t in (lo, hi)):
        raise ValueError(f"interval attention: lo and hi must be contiguous int32 {list(expected)} (key_intervals), "
                         f"got {lo.dtype} {tuple(lo.shape)} and {hi.dtype} {tuple(hi.shape)}")


def _by_position(t: Tensor) -> Tensor:
    """[B, H, S, D] seen as [B, S, H, D], with D contiguous."""
    t = t.transpose(1, 2)
    return t if t.stride(-1) == 1 else t.contiguous()


def _strides(tensors: list[Tensor], rotation: tuple[Tensor, Tensor] | None) -> Tensor:
    """The batch, position and head strides of [B, S, H, D] tensors, in the order the kernel reads them, then the
    RoPE tables' batch and position strides."""
    table = rotation[0].stride()[:2] if rotation is not None else (0, 0)
    return torch.tensor([s for t in tensors for s in t.stride()[:3]] + list(table), dtype=torch.int64)


def _tables(rotation: tuple[Tensor, Tensor] | None) -> tuple[int | None, int | None]:
    return (None, None) if rotation is None else (rotation[0].data_ptr(), rotation[1].data_ptr())


def _forward(q, k, v, lo, hi, scale, rotation):
    """(out [B, S, Hq, D], lse [B, Hq, S]) for q [B, S, H, D] and k, v [B, Sk, H, D] (Sk = S with `rotation`)."""
    batch, length, heads, width = q.shape
    out = q.new_empty(batch, length, heads, width)
    lse = q.new_empty(batch, heads, length)
    strides = _strides([q, k, v, out], rotation)
    c_kernels().library.bios_interval_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), strides.data_ptr(),
        lo.data_ptr(), hi.data_ptr(), *_tables(rotation), batch, length, k.shape[1], heads, k.shape[2], width, scale,
        torch.get_num_threads())
    return out, lse


def _backward(q, k, v, out, lse, lo, hi, scale, rotation, grad_out, grad_q, grad_k, grad_v) -> None:
    """The gradients into grad_q, grad_k, grad_v (views [B, S, H, D], written whole)."""
    batch, length, heads, width = q.shape
    grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
    strides = _strides([q, k, v, out, grad_out, grad_q, grad_k, grad_v], rotation)
    c_kernels().library.bios_interval_attention_backward(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), grad_out.data_ptr(),
        grad_q.data_ptr(), grad_k.data_ptr(), grad_v.data_ptr(), strides.data_ptr(), lo.data_ptr(), hi.data_ptr(),
        *_tables(rotation), batch, length, k.shape[1], heads, k.shape[2], width, scale, torch.get_num_threads())


class _IntervalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, lo, hi, scale):
        q, k, v = (_by_position(t) for t in (query, key, value))
        out, lse = _forward(q, k, v, lo, hi, scale, None)
        ctx.scale = scale
        ctx.save_for_backward(q, k, v, out, lse, lo, hi)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, lo, hi = ctx.saved_tensors
        grads = [torch.empty(t.shape, dtype=t.dtype) for t in (q, k, v)]
        _backward(q, k, v, out, lse, lo, hi, ctx.scale, None, grad_out, *grads)
        return *(g.transpose(1, 2) for g in grads), None, None, None


class _StackedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, heads, kv_heads, lo, hi, scale, cos, sin):
        ctx.shape = (heads, kv_heads)
        rotation = (cos, sin) if cos is not None else None
        out, lse = _forward(*split_stacked(qkv, *ctx.shape), lo, hi, scale, rotation)
        ctx.scale = scale
        ctx.save_for_backward(qkv, out, lse, lo, hi, *(rotation or ()))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        qkv, out, lse, lo, hi, *rotation = ctx.saved_tensors
        grad = torch.empty(qkv.shape, dtype=qkv.dtype)
        _backward(*split_stacked(qkv, *ctx.shape), out, lse, lo, hi, ctx.scale, tuple(rotation) or None,
                  grad_out.view(out.shape), *split_stacked(grad, *ctx.shape))
        return grad, None, None, None, None, None, None, None
