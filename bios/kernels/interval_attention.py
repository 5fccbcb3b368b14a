"""A training pass's attention on CPU where each query sees one interval of keys, computing only those pairs.

PyTorch's CPU flash attention multiplies every query by every key of a row of up to 512 and masks the causal half
afterwards: with `is_causal` it takes as long as without (SmolLM2's 4 rows x 128 positions, 9 query heads over 3
kv heads: 3.7-4.0 ms a layer forward and backward either way, AVX2 code, 2 threads). A causal row, a row of
packed sequences (each query sees its own sequence up to itself) and a sliding window all give each query one
interval of keys, `lo[b, i]..hi[b, i]`; `csrc/training_attention.c` multiplies a block of queries only by the
keys their intervals span and writes the output in the [batch, position, head, dim] layout the output projection
reads (no transposed copy). Forward and backward agree with SDPA to fp32 rounding (`tests/test_interval_attention.py`).

`key_intervals` reads the intervals off what Transformers hands an attention function (no mask and a causal
module, or a boolean mask whose every row is one non-empty interval); `suits` says whether the kernel takes the
tensors (fp32 on CPU, head width a multiple of two vectors, as many keys as queries, the C kernels built).
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from bios.kernels.c_kernels import c_kernels

# The last mask's intervals: a pass hands every layer the same mask, so they are read off it once a pass.
# (mask reference, its version, intervals); tensors compare elementwise, so the key is held by identity.
_last_mask: tuple[weakref.ref, int, tuple[Tensor, Tensor] | None] | None = None


def suits(query: Tensor, key: Tensor, value: Tensor) -> bool:
    """Whether `interval_attention` takes these [B, H, S, D] tensors: CPU, queries and keys of one length, keys
    and values of one width, a head width the kernel's tiles divide, whole groups of query heads per kv head,
    and the C kernels built (`BIOS_C_KERNELS` not off)."""
    if query.device.type != "cpu" or query.dim() != 4 or key.shape != value.shape:
        return False
    batch, heads, length, width = query.shape
    if key.shape[0] != batch or key.shape[2] != length or key.shape[3] != width or heads % key.shape[1]:
        return False
    kernels = c_kernels()
    return kernels is not None and width % (2 * kernels.width) == 0


def key_intervals(attention_mask: Tensor | None, causal: bool, batch: int, length: int) -> tuple[Tensor, Tensor] | None:
    """(lo, hi), int32 [batch, length]: query i of batch row b sees keys lo[b, i]..hi[b, i]. From no mask (causal
    or full rows), or a boolean [batch or 1, 1, length, length] mask (True attends) whose every row is one
    non-empty interval; None for anything else (a float mask, a query that sees no key, gaps)."""
    if attention_mask is None:
        positions = torch.arange(length, dtype=torch.int32)
        hi = positions if causal else torch.full((length,), length - 1, dtype=torch.int32)
        return torch.zeros(batch, length, dtype=torch.int32), hi.expand(batch, length).contiguous()
    if attention_mask.dtype != torch.bool or attention_mask.dim() != 4 or attention_mask.shape[1] != 1 \
            or attention_mask.shape[0] not in (1, batch) or tuple(attention_mask.shape[2:]) != (length, length):
        return None
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
    """Each row's first and last True key of mask [B, L, L], if every row's Trues are one non-empty run."""
    length = mask.shape[-1]
    counts = mask.sum(-1, dtype=torch.int32)
    if not bool((counts > 0).all()):
        return None
    as_int = mask.to(torch.int8)
    lo = as_int.argmax(-1).to(torch.int32)
    hi = (length - 1 - as_int.flip(-1).argmax(-1)).to(torch.int32)
    return (lo, hi) if bool((hi - lo + 1 == counts).all()) else None


def interval_attention(query: Tensor, key: Tensor, value: Tensor, lo: Tensor, hi: Tensor, scale: float) -> Tensor:
    """softmax(scale q kᵀ over each query's interval) v for fp32 query [B, Hq, S, D] and key, value [B, Hkv, S, D]
    (any strides with D contiguous; `suits` must hold), returned as [B, S, Hq, D] (contiguous), the layout
    Transformers' attention functions return. Differentiable in query, key and value."""
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return _IntervalAttention.apply(query, key, value, lo, hi, scale)
    return _forward(query, key, value, lo, hi, scale)[0]


def _by_position(t: Tensor) -> Tensor:
    """[B, H, S, D] seen as [B, S, H, D], with D contiguous."""
    t = t.transpose(1, 2)
    return t if t.stride(-1) == 1 else t.contiguous()


def _strides(*tensors: Tensor) -> Tensor:
    """The batch, position and head strides of [B, S, H, D] tensors, in the order the kernel reads them."""
    return torch.tensor([s for t in tensors for s in t.stride()[:3]], dtype=torch.int64)


def _forward(query, key, value, lo, hi, scale):
    q, k, v = (_by_position(t) for t in (query, key, value))
    batch, length, heads, width = q.shape
    out = q.new_empty(batch, length, heads, width)
    lse = q.new_empty(batch, heads, length)
    strides = _strides(q, k, v, out)
    c_kernels().library.bios_interval_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), strides.data_ptr(),
        lo.data_ptr(), hi.data_ptr(), batch, length, heads, k.shape[2], width, scale, torch.get_num_threads())
    return out, lse, (q, k, v)


class _IntervalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, lo, hi, scale):
        out, lse, (q, k, v) = _forward(query, key, value, lo, hi, scale)
        ctx.scale = scale
        ctx.save_for_backward(q, k, v, out, lse, lo, hi)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, lo, hi = ctx.saved_tensors
        grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
        grad_q, grad_k, grad_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        batch, length, heads, width = q.shape
        strides = _strides(q, k, v, out, grad_out, grad_q, grad_k, grad_v)
        c_kernels().library.bios_interval_attention_backward(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), grad_out.data_ptr(),
            grad_q.data_ptr(), grad_k.data_ptr(), grad_v.data_ptr(), strides.data_ptr(), lo.data_ptr(),
            hi.data_ptr(), batch, length, heads, k.shape[2], width, ctx.scale, torch.get_num_threads())
        return grad_q.transpose(1, 2), grad_k.transpose(1, 2), grad_v.transpose(1, 2), None, None, None
