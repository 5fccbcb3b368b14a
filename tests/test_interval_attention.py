"""A training pass's attention where each query sees one interval of keys (`bios.kernels.interval_attention`,
`csrc/training_attention.c`): output and the gradients of query, key and value against SDPA in float64 on the same
mask, for causal rows, packed sequences, a sliding window, full rows, padded rows and pads that see nothing, grouped heads, rows that
are not a whole number of blocks, both thread counts; a stacked q/k/v output RoPE'd in the kernel against
Transformers' RoPE then SDPA, and bit for bit against Bios's RoPE then the kernel; the intervals read off masks, and the masks it refuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import needs_c_kernels

from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from bios.kernels.interval_attention import interval_attention, key_intervals, stacked_attention, suits
from bios.kernels.rotary import rotary

pytestmark = [pytest.mark.usefixtures("fresh_c_kernels"), needs_c_kernels]

BATCH, HEADS, KV_HEADS, WIDTH = 2, 6, 2, 32


def _qkv(length: int, seed: int = 0):
    """q, k, v as Transformers hands them: [B, H, S, D] views of one projection output [B, S, (Hq + 2Hkv) D]."""
    generator = torch.Generator().manual_seed(seed)
    stacked = torch.randn(BATCH, length, (HEADS + 2 * KV_HEADS) * WIDTH, generator=generator)
    parts = stacked.split([HEADS * WIDTH, KV_HEADS * WIDTH, KV_HEADS * WIDTH], dim=-1)
    return [part.unflatten(-1, (-1, WIDTH)).transpose(1, 2) for part in parts]


def _mask(kind: str, length: int) -> torch.Tensor:
    """[B, 1, S, S] bool (True attends)."""
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    if kind == "causal":
        return causal.expand(BATCH, 1, length, length)
    if kind == "full":
        return torch.ones(BATCH, 1, length, length, dtype=torch.bool)
    if kind == "window":  # each query sees itself and the 4 keys before it
        return (causal & ~torch.ones(length, length, dtype=torch.bool).tril(-5)).expand(BATCH, 1, length, length)
    if kind == "packed":  # row 0: sequences of 7, 11 and the rest; row 1: one sequence
        sequence = torch.zeros(BATCH, length, dtype=torch.long)
        sequence[0, 7:18], sequence[0, 18:] = 1, 2
        same = sequence[:, :, None] == sequence[:, None, :]
        return (causal & same)[:, None]
    if kind == "padded":  # row 1 right-padded after 9 positions: its pads see the 9 real ones
        mask = causal.expand(BATCH, 1, length, length).clone()
        mask[1, 0, :, 9:] = False
        return mask
    if kind == "left-padded":  # row 1's first 6 positions are pads that see nothing (a batched prompt's)
        mask = causal.expand(BATCH, 1, length, length).clone()
        mask[1, 0, :, :6] = False
        return mask
    raise ValueError(kind)


def _reference(query, key, value, mask, scale):
    """SDPA in float64, output [B, S, H, D], and the float64 gradients for `grad`."""
    q, k, v = (t.double().detach().requires_grad_() for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2), (q, k, v)


@pytest.mark.parametrize("kind", ["causal", "packed", "window", "full", "padded", "left-padded"])
@pytest.mark.parametrize("length", [37, 64])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_sdpa_forward_and_backward(kind, length, threads, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    query, key, value = (t.detach().requires_grad_() for t in _qkv(length))
    mask = _mask(kind, length)
    intervals = key_intervals(None, True, BATCH, length) if kind == "causal" else key_intervals(mask, True, BATCH,
                                                                                                length)
    assert intervals is not None and suits(query, key, value)
    out = interval_attention(query, key, value, *intervals, 0.3)
    sees = mask.any(-1).transpose(1, 2)[..., None]  # [B, S, 1, 1]: a query that sees no key gives zeros
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)) * sees  # (pads' outputs are dropped)
    expected, inputs = _reference(query, key, value, mask | ~mask.any(-1, keepdim=True), 0.3)  # SDPA: NaN rows
    out.backward(grad)
    expected.backward(grad.double())
    assert out.shape == (BATCH, length, HEADS, WIDTH) and out.is_contiguous()
    torch.testing.assert_close(out.double(), expected * sees, atol=2e-6, rtol=0)
    for ours, theirs in zip((query, key, value), inputs):
        torch.testing.assert_close(ours.grad.double(), theirs.grad, atol=2e-5, rtol=0)


@pytest.mark.parametrize("threads", [1, 2])
def test_queries_at_some_of_the_keys_positions_match_those_rows_of_the_whole(threads, monkeypatch):
    """A split row's share (`bios.worker.context_parallel`): queries at some positions, each over every key up
    to its own, give those rows of the whole row's attention, and those rows' share of its gradients."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    length, positions = 45, torch.tensor([0, 1, 2, 3, 4, 5, 30, 31, 32, 33, 44])
    query, key, value = (t.detach().requires_grad_() for t in _qkv(length, seed=3))
    mine = query.detach()[:, :, positions].requires_grad_()
    assert suits(mine, key, value, same_length=False) and not suits(mine, key, value)
    lo = torch.zeros(BATCH, len(positions), dtype=torch.int32)
    hi = positions.to(torch.int32).expand(BATCH, -1).contiguous()
    out = interval_attention(mine, key, value, lo, hi, 0.3)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    whole_grad = torch.zeros(BATCH, length, HEADS, WIDTH)
    whole_grad[:, positions] = grad  # the other rows' outputs count for nothing
    expected, inputs = _reference(query, key, value, _mask("causal", length), 0.3)
    out.backward(grad)
    expected.backward(whole_grad.double())
    torch.testing.assert_close(out.double(), expected[:, positions], atol=2e-6, rtol=0)
    torch.testing.assert_close(mine.grad.double(), inputs[0].grad[:, :, positions], atol=2e-5, rtol=0)
    for ours, theirs in zip((key, value), inputs[1:]):
        torch.testing.assert_close(ours.grad.double(), theirs.grad, atol=2e-5, rtol=0)


def _tables(length: int, rows: int):
    """Transformers-style RoPE tables [rows, S, D] (each angle twice), rows 1 broadcasting over the batch."""
    angles = torch.randn(rows, length, WIDTH // 2, generator=torch.Generator().manual_seed(2)) * 3
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("kind", ["causal", "packed"])
@pytest.mark.parametrize("table_rows", [1, BATCH])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_stacked_projection_with_rope_matches_rope_then_sdpa(kind, table_rows, threads, monkeypatch):
    """One kernel call for RoPE and attention of a q/k/v projection output, and one gradient for all of it."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    length = 45
    query, key, value = _qkv(length, seed=4)
    qkv = query._base.detach().requires_grad_()  # the stacked output q, k and v are views of
    cos, sin = _tables(length, table_rows)
    mask = _mask(kind, length)
    intervals = key_intervals(None if kind == "causal" else mask, True, BATCH, length)
    out = stacked_attention(qkv, HEADS, KV_HEADS, *intervals, 0.2, cos, sin)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    out.backward(grad)

    exact = qkv.detach().double().requires_grad_()
    q, k, v = (part.unflatten(-1, (-1, WIDTH)).transpose(1, 2)
               for part in exact.split([HEADS * WIDTH, KV_HEADS * WIDTH, KV_HEADS * WIDTH], dim=-1))
    q, k = apply_rotary_pos_emb(q, k, cos.double(), sin.double())
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.2, enable_gqa=True)
    expected = expected.transpose(1, 2).flatten(-2)
    expected.backward(grad.double())
    assert out.shape == (BATCH, length, HEADS * WIDTH)
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=0)
    torch.testing.assert_close(qkv.grad.double(), exact.grad, atol=2e-5, rtol=0)
    with torch.no_grad():
        assert torch.equal(stacked_attention(qkv, HEADS, KV_HEADS, *intervals, 0.2, cos, sin), out.detach())


@pytest.mark.parametrize("threads", [1, 2])
def test_a_stacked_call_is_rope_then_the_kernel_bit_for_bit(threads, monkeypatch):
    """RoPE inside the kernel rounds as `bios.kernels.rotary` (Transformers' numbers) does, so the training forward
    (stacked) and a prompt's prefill (RoPE, then the attention function) see the same bits, and so do gradients."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    query, key, value = _qkv(45, seed=6)
    cos, sin = _tables(45, BATCH)
    intervals = key_intervals(_mask("packed", 45), True, BATCH, 45)
    grad = torch.randn(BATCH, 45, HEADS * WIDTH, generator=torch.Generator().manual_seed(7))
    stacked = query._base.detach().requires_grad_()
    out = stacked_attention(stacked, HEADS, KV_HEADS, *intervals, 0.2, cos, sin)
    out.backward(grad)
    apart = query._base.detach().requires_grad_()
    query_key, value = apart.split([(HEADS + KV_HEADS) * WIDTH, KV_HEADS * WIDTH], dim=-1)
    query, key = rotary(query_key, cos, sin).split([HEADS * WIDTH, KV_HEADS * WIDTH], dim=-1)
    query, key, value = (part.unflatten(-1, (-1, WIDTH)).transpose(1, 2) for part in (query, key, value))
    expected = interval_attention(query, key, value, *intervals, 0.2).flatten(-2)
    expected.backward(grad)
    assert torch.equal(out, expected) and torch.equal(stacked.grad, apart.grad)


def test_no_gradient_wanted_gives_the_same_output():
    query, key, value = _qkv(40)
    intervals = key_intervals(None, True, BATCH, 40)
    with torch.no_grad():
        plain = interval_attention(query, key, value, *intervals, 0.25)
    tracked = interval_attention(*(t.detach().requires_grad_() for t in (query, key, value)), *intervals, 0.25)
    assert torch.equal(plain, tracked.detach())


def test_intervals_read_off_masks():
    lo, hi = key_intervals(_mask("packed", 30), True, BATCH, 30)
    assert lo[0, :7].eq(0).all() and lo[0, 7:18].eq(7).all() and lo[0, 18:].eq(18).all() and lo[1].eq(0).all()
    assert torch.equal(hi[0], torch.arange(30, dtype=torch.int32))
    lo, hi = key_intervals(_mask("left-padded", 8), True, BATCH, 8)  # a query that sees nothing: (0, -1)
    assert lo[1, :6].eq(0).all() and hi[1, :6].eq(-1).all() and lo[1, 6:].eq(6).all()
    lo, hi = key_intervals(None, False, BATCH, 5)  # no mask, not causal: every key
    assert lo.eq(0).all() and hi.eq(4).all()
    one_row = key_intervals(_mask("window", 12)[:1], True, BATCH, 12)  # a mask of batch 1 broadcasts
    assert one_row[0].shape == (BATCH, 12) and one_row[0][1, 11] == 7


def test_masks_that_are_not_one_interval_per_query_are_refused():
    gaps = _mask("causal", 16).clone()
    gaps[0, 0, 10, 3] = False  # query 10 skips key 3
    additive = torch.zeros(BATCH, 1, 16, 16)
    per_head = torch.ones(BATCH, HEADS, 16, 16, dtype=torch.bool)
    for mask in (gaps, additive, per_head):
        assert key_intervals(mask, True, BATCH, 16) is None


def test_what_the_kernel_would_misread_is_refused_with_what_was_given():
    query, key, value = _qkv(16)
    lo, hi = key_intervals(None, True, BATCH, 16)
    with pytest.raises(TypeError, match="fp32 CPU"):
        interval_attention(query.double(), key.double(), value.double(), lo, hi, 0.1)
    with pytest.raises(ValueError, match=r"int32 \[2, 16\]"):
        interval_attention(query, key, value, lo[:, :8], hi, 0.1)
    qkv = query._base
    cos, sin = _tables(15, 1)  # one position short
    with pytest.raises(ValueError, match=r"cos and sin must be \[2 or 1, 16, 32\]"):
        stacked_attention(qkv, HEADS, KV_HEADS, lo, hi, 0.1, cos, sin)


def test_what_the_kernel_does_not_take(monkeypatch):
    query, key, value = _qkv(16)
    assert not suits(query[..., :24], key[..., :24], value[..., :24])  # a width the tiles do not divide
    assert not suits(query, key[:, :, :8], value[:, :, :8])  # fewer keys than queries (a cache)
    monkeypatch.setenv("BIOS_C_KERNELS", "off")
    assert not suits(query, key, value)
