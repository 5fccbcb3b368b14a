"""RoPE for training passes: x·cos + rotate_half(x)·sin over many heads, one call each way.

Transformers' `apply_rotary_pos_emb` is ten ops forward (halves sliced, one negated, concatenated, four products,
two sums) and more back (each slice's gradient a zero-filled copy): SmolLM2's 4 x 128 tokens, 1.3 ms a layer
forward and backward with AVX2 code, ~38 ms of a 1.9 s fp32 step. `rotary` rotates query and key heads side by
side in one C call each way on fp32 and bf16 CPU tensors (`bios_rotate`, csrc/decode_ops.c; `bios_rotate_bf16`,
csrc/training_ops.c; on PyTorch's threads), three PyTorch ops each way elsewhere (GPUs, no compiler). The numbers are Transformers' bit for bit both ways:
rotate_half(x)·sin is x's halves swapped times sin with its first half negated, and its gradient the gradient's
halves swapped times sin with its halves swapped and its second half negated.
"""

from __future__ import annotations

import torch
from torch import Tensor

from bios.kernels.c_kernels import c_library_for
from bios.kernels.grad_wanted import grad_wanted


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE of x [..., heads x d] (heads side by side; the last dim contiguous, the others any strides) by cos and
    sin [..., d] (the model's rotary embedding; leading dims x's or broadcast to them): a new tensor like x."""
    width = cos.shape[-1]
    try:
        if x.shape[-1] % width or width % 2 or cos.shape != sin.shape:
            raise RuntimeError
        cos, sin = (t.expand(*x.shape[:-1], width) for t in (cos, sin))
    except RuntimeError:
        raise ValueError(f"rotary: x [..., heads x d] and cos/sin [..., d] with leading dims that broadcast to x's, "
                         f"got {tuple(x.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}") from None
    signed = signed_sin(sin)
    if grad_wanted(cos, sin):  # tables that train (Transformers' never do): autograd through PyTorch's ops
        return _rotate_by_ops(x, cos, signed)
    if grad_wanted(x):
        return _Rotary.apply(x, cos, signed)
    return _rotate(x, cos, signed)


def signed_sin(sin: Tensor) -> Tensor:
    """sin with its first half negated: rotate_half(x)·sin = x's halves swapped · this (`rotate_heads`, and the C
    kernels' `signed_sin`)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate_heads(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """RoPE on PyTorch's ops of x [..., d] by cos and `signed_sin` broadcast to it: x·cos + (x's halves
    swapped)·signed_sin, Transformers' `apply_rotary_pos_emb` bit for bit, in three ops."""
    return (x * cos) + (x.roll(x.shape[-1] // 2, dims=-1) * signed_sin)


def _rotate(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """x·cos + (x's halves swapped)·signed_sin, per head, as a new tensor [..., heads x d]."""
    width = cos.shape[-1]
    rows, heads = cos.numel() // width, x.shape[-1] // width
    library = c_library_for(x, cos, signed_sin, dtypes=(torch.float32, torch.bfloat16), whole=False) \
        if _one_run_of_rows(x) else None
    if library is None:
        return _rotate_by_ops(x, cos, signed_sin)
    flat = x.view(rows, x.shape[-1])  # a [batch, tokens, heads x d] slice of a stacked output: rows strided
    cos, signed_sin = cos.contiguous(), signed_sin.contiguous()  # (held: the kernel reads their memory)
    out = x.new_empty(x.shape)
    rotate = library.bios_rotate_bf16 if x.dtype == torch.bfloat16 else library.bios_rotate
    rotate(flat.data_ptr(), flat.stride(0), out.data_ptr(), x.shape[-1], rows, heads, width, cos.data_ptr(),
           signed_sin.data_ptr(), torch.get_num_threads())
    return out


def _rotate_by_ops(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """`_rotate` on PyTorch's ops (`rotate_heads` head by head)."""
    width = cos.shape[-1]
    by_head = x.unflatten(-1, (x.shape[-1] // width, width))
    return rotate_heads(by_head, cos.unsqueeze(-2), signed_sin.unsqueeze(-2)).flatten(-2)


def _one_run_of_rows(x: Tensor) -> bool:
    """Whether x's leading dims are one run of rows (a view [rows, last], no copy), as the kernel walks them."""
    try:
        x.view(-1, x.shape[-1])
    except RuntimeError:
        return False
    return True


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, signed_sin):
        ctx.save_for_backward(cos, signed_sin)
        return _rotate(x, cos, signed_sin)

    @staticmethod
    def backward(ctx, grad):
        cos, signed_sin = ctx.saved_tensors
        # dx = g·cos + (g's halves swapped)·(sin's halves swapped, the second negated): autograd's numbers through
        # rotate_half's slices, negation and concatenation
        back_sin = signed_sin.roll(signed_sin.shape[-1] // 2, dims=-1)
        return _rotate(grad, cos, back_sin), None, None
