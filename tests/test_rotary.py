"""A training pass's RoPE (`bios.kernels.rotary`): forward and backward bit for bit Transformers'
`apply_rotary_pos_emb` and autograd through it, in C (fp32 and bf16 on CPU) and on PyTorch's ops
(`BIOS_C_KERNELS=off`, and float64, which the C kernels do not take), on query and key heads sliced from a stacked
q/k/v output."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_c_kernels
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from bios.kernels.rotary import rotary

pytestmark = pytest.mark.usefixtures("fresh_c_kernels")

BATCH, TOKENS, HEADS, KV_HEADS, HEAD_DIM = 2, 33, 6, 2, 16


def _inputs(dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(BATCH, TOKENS, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=generator, dtype=dtype)
    angles = torch.randn(BATCH, TOKENS, HEAD_DIM // 2, generator=generator, dtype=dtype) * 3
    angles = torch.cat((angles, angles), dim=-1)  # as Transformers' rotary embeddings lay them out
    grad = torch.randn(BATCH, TOKENS, (HEADS + KV_HEADS) * HEAD_DIM, generator=generator, dtype=dtype)
    return qkv, angles.cos(), angles.sin(), grad


def _transformers(qkv, cos, sin, grad):
    qkv = qkv.clone().requires_grad_()
    query, key, _ = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    query, key = (part.unflatten(-1, (-1, HEAD_DIM)).transpose(1, 2) for part in (query, key))
    query, key = apply_rotary_pos_emb(query, key, cos, sin)
    out = torch.cat([part.transpose(1, 2).flatten(-2) for part in (query, key)], dim=-1)
    out.backward(grad)
    return out.detach(), qkv.grad


def _ours(qkv, cos, sin, grad):
    qkv = qkv.clone().requires_grad_()
    out = rotary(qkv[..., : (HEADS + KV_HEADS) * HEAD_DIM], cos, sin)  # rows strided: a slice of q/k/v
    out.backward(grad)
    return out.detach(), qkv.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
@needs_c_kernels
def test_c_rotation_is_transformers_bit_for_bit_both_ways(threads, dtype):
    inputs = _inputs(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ours = _ours(*inputs)
    finally:
        torch.set_num_threads(before)
    expected = _transformers(*inputs)
    assert torch.equal(ours[0], expected[0])
    assert torch.equal(ours[1], expected[1])  # the values' part of the gradient zero, as through autograd


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_pytorch_ops_rotation_is_transformers_bit_for_bit_both_ways(dtype, monkeypatch):
    monkeypatch.setenv("BIOS_C_KERNELS", "off")
    inputs = _inputs(dtype, seed=1)
    ours, expected = _ours(*inputs), _transformers(*inputs)
    assert torch.equal(ours[0], expected[0]) and torch.equal(ours[1], expected[1])


def test_no_gradient_wanted_gives_the_same_numbers_without_a_graph():
    qkv, cos, sin, _ = _inputs(torch.float32, seed=2)
    rotated = rotary(qkv[..., : HEADS * HEAD_DIM], cos, sin)
    assert rotated.grad_fn is None
    assert torch.equal(rotated, _transformers(qkv, cos, sin, torch.zeros(BATCH, TOKENS, (HEADS + KV_HEADS) * HEAD_DIM))
                       [0][..., : HEADS * HEAD_DIM])


def test_mismatched_shapes_say_what_was_given():
    qkv, cos, sin, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match=r"x \[..., heads x d\].*\(2, 33, 100\)"):
        rotary(qkv[..., :100], cos, sin)
    with pytest.raises(ValueError, match="broadcast"):
        rotary(qkv, cos[:, :5], sin[:, :5])


def test_tables_of_one_row_broadcast_over_the_batch():
    qkv, cos, sin, _ = _inputs(torch.float32, seed=3)
    x = qkv[..., : HEADS * HEAD_DIM]
    assert torch.equal(rotary(x, cos[:1], sin[:1]), rotary(x, cos[:1].expand_as(cos), sin[:1].expand_as(sin)))


def test_tables_that_train_get_their_gradient_and_x_its_own():
    qkv, cos, sin, grad = _inputs(torch.float32, seed=4)
    x = qkv[..., : (HEADS + KV_HEADS) * HEAD_DIM].clone().requires_grad_()
    cos, sin = cos.clone().requires_grad_(), sin.clone().requires_grad_()
    rotary(x, cos, sin).backward(grad)
    expected = [t.detach().clone().requires_grad_() for t in (x, cos, sin)]
    heads = expected[0].unflatten(-1, (-1, HEAD_DIM)).transpose(1, 2)
    rotated = apply_rotary_pos_emb(heads, heads, expected[1], expected[2])[0]
    rotated.transpose(1, 2).flatten(-2).backward(grad)
    for ours, theirs in zip((x, cos, sin), expected):
        torch.testing.assert_close(ours.grad, theirs.grad)
