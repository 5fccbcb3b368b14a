"""q/k/v and gate/up run as one GEMM per group (`lora_linear_blocks`, `bios.worker.projection_groups`) with
exactly the numbers of one GEMM per layer, whatever order or inputs the layers are called with."""

import pytest
import torch
from test_engine import tiny_llama

from bios.kernels import lora_linear_multi
from bios.kernels.lora import BlockSegment, lora_linear_blocks
from bios.worker.lora import LoraSegment, attach_lora


def _inputs(sizes, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(10, 3, 12, generator=gen, dtype=dtype, requires_grad=True)
    weight = torch.randn(sum(sizes), 12, generator=gen, dtype=dtype, requires_grad=True)
    bias = torch.randn(sum(sizes), generator=gen, dtype=dtype, requires_grad=True)
    factors = {(segment, block): (torch.randn(r, 12, generator=gen, dtype=dtype, requires_grad=True),
                                  torch.randn(sizes[block], r, generator=gen, dtype=dtype, requires_grad=True))
               for segment, r in ((0, 4), (1, 2)) for block in range(len(sizes))}
    return x, weight, bias, factors


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_blocks_equal_one_lora_linear_per_block_in_values_and_gradients(dtype):
    sizes = [7, 3, 5]
    x, weight, bias, factors = _inputs(sizes, dtype=dtype)
    # adapter 0 on rows 1-4 trains every block; adapter 1 on rows 6-9 trains blocks 0 and 2 only
    segments = [BlockSegment(1, 4, 0.5, tuple((b, *factors[0, b]) for b in range(3))),
                BlockSegment(6, 9, 2.0, tuple((b, *factors[1, b]) for b in (0, 2)))]
    outputs = lora_linear_blocks(x, weight, bias, sizes, segments)
    offsets = [0, 7, 10, 15]
    expected = []
    for block in range(3):
        rows = slice(offsets[block], offsets[block + 1])
        used = [(s, segment) for s, segment in enumerate(segments) if block in [f[0] for f in segment.factors]]
        expected.append(lora_linear_multi(
            x, weight[rows], bias[rows], [factors[s, block][0] for s, _ in used],
            [factors[s, block][1] for s, _ in used], [segment.scale for _, segment in used],
            [(segment.start, segment.end) for _, segment in used]))
    leaves = [x, weight, bias, *[t for pair in factors.values() for t in pair]]
    upstream = [torch.randn_like(out) for out in outputs]
    tolerance = 1e-10 if dtype == torch.float64 else 1e-5
    for out, ref in zip(outputs, expected):
        torch.testing.assert_close(out, ref, atol=tolerance, rtol=tolerance)
    got = torch.autograd.grad(outputs, leaves, upstream, allow_unused=True)
    want = torch.autograd.grad(expected, leaves, upstream, allow_unused=True)
    for name, a, b in zip(["x", "weight", "bias", *map(str, range(12))], got, want):
        if b is None:  # adapter 1's block-1 factors are in no segment: no gradient either way
            assert a is None, name
        else:
            torch.testing.assert_close(a, b, atol=tolerance * 10, rtol=tolerance * 10, msg=name)


def test_blocks_gradcheck_with_a_block_left_without_gradient():
    sizes = [2, 3]
    x, weight, bias, factors = _inputs(sizes, seed=1)
    x = x[:4, :1].detach().requires_grad_()
    a0, b0 = factors[0, 0]
    a1, b1 = factors[0, 1]

    def first_block_only(x, a0, b0, a1, b1):  # block 1's output is unused: autograd gives it no gradient
        return lora_linear_blocks(x, weight.detach(), None, sizes, [BlockSegment(0, 3, 0.7, ((0, a0, b0), (1, a1, b1)))])[0]

    assert torch.autograd.gradcheck(first_block_only, (x, a0, b0, a1, b1))


def test_a_llama_groups_q_k_v_and_gate_up_into_views_of_one_weight():
    model = tiny_llama()
    before = sum(p.numel() for p in model.parameters())
    attach_lora(model)
    layer = model.model.layers[0]
    attention, mlp = layer.self_attn, layer.mlp
    assert attention.q_proj.projection_group is attention.v_proj.projection_group
    assert mlp.gate_proj.projection_group is mlp.up_proj.projection_group
    assert getattr(attention.o_proj, "projection_group", None) is None
    storages = {p.untyped_storage().data_ptr() for p in (attention.q_proj.weight, attention.k_proj.weight,
                                                          attention.v_proj.weight)}
    assert len(storages) == 1  # views of one stacked weight, not copies
    assert sum(p.numel() for p in model.parameters()) == before


def test_a_member_called_alone_or_with_another_input_gives_its_own_output(monkeypatch):
    model = tiny_llama()
    attach_lora(model)
    attention = model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(0)
    for proj in (attention.q_proj, attention.k_proj, attention.v_proj):
        a = torch.randn(4, proj.in_features, generator=gen)
        b = torch.randn(proj.out_features, 4, generator=gen)
        proj.lora_segments = [LoraSegment(1, 3, a, b, 0.5)]
    x, other = torch.randn(4, 5, attention.q_proj.in_features, generator=gen).unbind(0)[:2]
    x, other = x[None].expand(3, -1, -1).clone(), other[None].expand(3, -1, -1).clone()

    def alone(proj, inputs):
        monkeypatch.setenv("BIOS_KERNELS", "0")
        try:
            return proj(inputs)
        finally:
            monkeypatch.setenv("BIOS_KERNELS", "1")

    expected = {name: alone(getattr(attention, name), x) for name in ("q_proj", "k_proj", "v_proj")}
    torch.testing.assert_close(attention.k_proj(x), expected["k_proj"])  # k first, then q with another input
    torch.testing.assert_close(attention.q_proj(other), alone(attention.q_proj, other))
    torch.testing.assert_close(attention.v_proj(x), expected["v_proj"])  # v again with x: computed afresh
    for name in ("q_proj", "k_proj", "v_proj"):  # the usual order: one GEMM, three outputs
        torch.testing.assert_close(getattr(attention, name)(x), expected[name])
