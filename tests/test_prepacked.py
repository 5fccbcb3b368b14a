"""Prepacked frozen weights for decode steps (bios.kernels.prepacked): inside `PrepackedWeights.using()` fp32
and bf16 products on CPU multiply by a oneDNN-laid-out copy of the weight, made once and kept across blocks
until released or until the weight is freed; the numbers are those of the plain weight; nothing is packed
outside a block, with `BIOS_PREPACK=off` or `BIOS_GEMM=aten`, or past half of the free memory. The worker keeps
copies across cycles that only sample and releases them before anything else. A decode step whose rows all use
one fp32 adapter multiplies by one copy of `W + scale·B·A`, remade when the adapter changes; in bf16 by one of
`[W; A]`. On Intel CPUs an fp32 copy is an MKL pack for the block's rows, fewer padded and more taken in parts.
"""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import bios.kernels.prepacked as prepacked_module
from bios import messages as m
from bios import types
from bios.kernels import gemm_choice
from bios.kernels.frozen_matmul import frozen_linear, merged_product, onednn_linear, stacked_product
from bios.kernels.prepacked import MklPack, PrepackedWeights, prepacked


def merged_linear(x, *args):
    """`merged_product`'s product applied to x, None where there is no copy."""
    product = merged_product(x, *args)
    return None if product is None else product(x)


def stacked_linear(x, *args):
    """`stacked_product`'s product applied to x, None where there is no copy."""
    product = stacked_product(x, *args)
    return None if product is None else product(x)


def _inputs(dtype=torch.float32, rows=16):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 96, generator=generator).to(dtype)
    weight = torch.randn(200, 96, generator=generator).to(dtype)
    bias = torch.randn(200, generator=generator).to(dtype)
    return x, weight, bias


@pytest.fixture(autouse=True)
def _defaults(monkeypatch):
    monkeypatch.delenv("BIOS_PREPACK", raising=False)
    monkeypatch.delenv("BIOS_GEMM", raising=False)
    monkeypatch.setattr(gemm_choice, "intel_cpu", lambda: False)  # oneDNN's copies (MKL's: the tests that say so)
    monkeypatch.setenv("BIOS_C_KERNELS", "off")  # the row kernel's packs: the tests that say so


def test_decode_products_multiply_by_one_kept_copy_with_the_plain_weights_numbers():
    x, weight, bias = _inputs()
    keeper = PrepackedWeights()
    with torch.inference_mode(), keeper.using():
        first = frozen_linear(x, weight, bias)
        copy = prepacked(x, weight)
        rows3d = frozen_linear(x[:, None], weight, bias)
    with torch.inference_mode(), keeper.using():  # the next call reuses it
        again = frozen_linear(x[:7], weight, bias)
        assert prepacked(x[:7], weight) is copy
    assert copy is not None and copy.is_mkldnn and keeper.held_bytes() == weight.numel() * 4
    assert torch.equal(first, onednn_linear(x, weight, bias))  # oneDNN's own numbers, bit for bit
    torch.testing.assert_close(first, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(again, F.linear(x[:7], weight, bias), rtol=1e-5, atol=1e-4)
    assert rows3d.shape == (16, 1, 200)
    torch.testing.assert_close(rows3d[:, 0], first, rtol=1e-5, atol=1e-4)
    keeper.release()
    assert keeper.held_bytes() == 0
    with torch.inference_mode(), keeper.using():
        assert prepacked(x, weight) is not copy


def test_on_intel_cpus_fp32_copies_are_mkl_packs_for_the_blocks_rows(monkeypatch):
    monkeypatch.setattr(gemm_choice, "intel_cpu", lambda: True)
    x, weight, bias = _inputs(rows=37)
    keeper = PrepackedWeights()
    with torch.inference_mode(), keeper.using(rows=16):
        copy = prepacked(x[:16], weight)
        results = {rows: frozen_linear(x[:rows], weight, bias) for rows in (16, 7, 37)}  # fewer: padded; more: parts
        rows3d = frozen_linear(x[:16, None], weight, bias)
        assert prepacked(x[:7], weight) is copy
    assert isinstance(copy, MklPack) and copy.rows == 16 and keeper.held_bytes() == weight.numel() * 4
    for rows, result in results.items():
        torch.testing.assert_close(result, F.linear(x[:rows], weight, bias), rtol=1e-5, atol=1e-4)
    assert rows3d.shape == (16, 1, 200) and torch.equal(rows3d[:, 0], results[16])
    with torch.inference_mode(), keeper.using(rows=9):  # a smaller batch: padded up to the copy's 16 rows
        assert prepacked(x[:9], weight) is copy
    with torch.inference_mode(), keeper.using(rows=2):  # one or two rows: the plain weight's product, no copy
        assert prepacked(x[:2], weight) is None
        torch.testing.assert_close(frozen_linear(x[:2], weight, bias), F.linear(x[:2], weight, bias))
    with torch.inference_mode(), keeper.using(rows=20):  # a larger one: packed anew for the next multiple of 16
        again = prepacked(x[:20], weight)
    assert isinstance(again, MklPack) and again.rows == 32 and keeper.held_bytes() == weight.numel() * 4
    lora_a, lora_b = _factors(weight)
    with torch.inference_mode(), keeper.using(adapter=True, rows=5):  # 5 rows: packs for 8
        merged = merged_linear(x[:5], weight, bias, lora_a, lora_b, 0.5)
        assert prepacked(x[:5], weight, lora_a=lora_a, lora_b=lora_b, scale=0.5).rows == 8
    torch.testing.assert_close(merged, F.linear(x[:5], weight, bias) + 0.5 * (x[:5] @ lora_a.T) @ lora_b.T,
                               rtol=1e-5, atol=1e-4)
    monkeypatch.setenv("BIOS_GEMM", "onednn")  # oneDNN's copies on request
    with torch.inference_mode(), keeper.using(rows=8):
        assert prepacked(x[:8], weight).is_mkldnn
    assert keeper.held_bytes() == weight.numel() * 4  # in place of the MKL pack; the merged copy went with its block


def test_a_view_taken_anew_each_call_reuses_its_copy():
    x, weight, _ = _inputs()
    stored = weight.T.contiguous()  # stored [in, out], as GPT-2's Conv1D does; it multiplies by `stored.T`
    keeper = PrepackedWeights()
    with torch.inference_mode(), keeper.using():
        first = prepacked(x, stored.T)
        assert prepacked(x, stored.T) is first
        result = frozen_linear(x, stored.T)
    assert keeper.held_bytes() == weight.numel() * 4
    torch.testing.assert_close(result, F.linear(x, weight), rtol=1e-5, atol=1e-4)
    del stored
    gc.collect()
    assert keeper.held_bytes() == 0


def test_bf16_decode_products_agree_with_pytorchs_and_are_packed_only_where_onednn_runs_bf16():
    x, weight, bias = _inputs(torch.bfloat16)
    with torch.inference_mode(), PrepackedWeights().using():
        result = frozen_linear(x, weight, bias)
        packed = prepacked(x, weight) is not None
    assert packed == torch.ops.mkldnn._is_mkldnn_bf16_supported()  # AVX2-only CPUs: oneDNN refuses bf16
    torch.testing.assert_close(result.float(), F.linear(x.float(), weight.float(), bias.float()), rtol=2e-2,
                               atol=0.25)


def test_nothing_is_packed_outside_a_block_when_off_or_for_aten(monkeypatch):
    x, weight, bias = _inputs()
    keeper = PrepackedWeights()
    assert prepacked(x, weight) is None  # outside any block
    monkeypatch.setenv("BIOS_GEMM", "aten")
    with torch.inference_mode(), keeper.using():
        torch.testing.assert_close(frozen_linear(x, weight, bias), F.linear(x, weight, bias))
    assert keeper.held_bytes() == 0
    monkeypatch.delenv("BIOS_GEMM")
    with keeper.using():
        prepacked(x, weight)
    assert keeper.held_bytes() > 0
    monkeypatch.setenv("BIOS_PREPACK", "off")  # drops what was kept, makes nothing
    with keeper.using():
        assert prepacked(x, weight) is None
    assert keeper.held_bytes() == 0
    monkeypatch.setenv("BIOS_PREPACK", "sometimes")
    with pytest.raises(ValueError, match="BIOS_PREPACK must be 'auto' or 'off'"), keeper.using():
        pass


def test_copies_take_at_most_half_the_free_memory(monkeypatch):
    x, weight, bias = _inputs()
    nbytes = weight.numel() * weight.element_size()
    other = torch.randn(200, 96)
    monkeypatch.setattr(prepacked_module.psutil, "virtual_memory", lambda: SimpleNamespace(available=3 * nbytes))
    keeper = PrepackedWeights()
    with torch.inference_mode(), keeper.using():
        assert prepacked(x, weight) is not None  # 1 of 1.5 copies' room
        assert prepacked(x, other) is None
        torch.testing.assert_close(frozen_linear(x, other, bias), F.linear(x, other, bias), rtol=1e-5, atol=1e-4)
    assert keeper.held_bytes() == nbytes


def test_a_freed_weights_copy_goes_with_it():
    x, weight, _ = _inputs()
    keeper = PrepackedWeights()
    with torch.inference_mode(), keeper.using():
        prepacked(x, weight)
    assert keeper.held_bytes() == weight.numel() * 4
    del weight
    gc.collect()
    assert keeper.held_bytes() == 0


def test_the_worker_keeps_copies_across_cycles_that_only_sample_and_releases_them_before_other_work():
    from bios.worker.executor import CycleExecutor
    from bios.worker.pool import ModelPool

    executor = CycleExecutor(ModelPool(device=torch.device("cpu")), group=SimpleNamespace(tp=1))  # no collective
    x, weight, _ = _inputs()
    with executor.prepacked.using():
        prepacked(x, weight)
    reports = []
    sample = m.Sample("session", 0, types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=1),
                      base_model="not-loaded")
    executor.run(m.RunCycle(1, 0, [m.WorkItem("sample", sample)]), reports.append)
    assert reports[-1].request_id == "sample" and reports[-1].error  # failed alone: no such base model here
    assert executor.prepacked.held_bytes() == weight.numel() * 4
    step = m.OptimStep("run-not-here", 0, types.AdamParams())
    executor.run(m.RunCycle(2, 0, [m.WorkItem("step", step)]), reports.append)
    assert reports[-1].request_id == "step"
    assert executor.prepacked.held_bytes() == 0


def _factors(weight, rank=4):
    generator = torch.Generator().manual_seed(1)
    lora_a = torch.randn(rank, weight.shape[1], generator=generator).to(weight.dtype)
    lora_b = torch.randn(weight.shape[0], rank, generator=generator).to(weight.dtype)
    return lora_a, lora_b


def test_one_adapters_rows_multiply_by_a_merged_copy_remade_when_the_adapter_changes():
    x, weight, bias = _inputs()
    lora_a, lora_b = _factors(weight)
    keeper = PrepackedWeights()
    with torch.inference_mode(), keeper.using():
        assert merged_linear(x, weight, bias, lora_a, lora_b, 0.5) is None  # only in blocks opened to merge
    with torch.inference_mode(), keeper.using(adapter=True):
        merged = merged_linear(x, weight, bias, lora_a, lora_b, 0.5)
        copy = prepacked(x, weight, lora_a=lora_a, lora_b=lora_b, scale=0.5)
        assert prepacked(x, weight, lora_a=lora_a, lora_b=lora_b, scale=0.5) is copy
        assert prepacked(x, weight, lora_a=lora_a, lora_b=lora_b, scale=2.0) is not copy  # another scale
        base = prepacked(x, weight)  # the base model's copy is another one
    expected = F.linear(x, weight, bias) + 0.5 * (x @ lora_a.T) @ lora_b.T
    torch.testing.assert_close(merged, expected, rtol=1e-5, atol=1e-4)
    assert base is not copy and keeper.held_bytes() == 3 * weight.numel() * 4
    with torch.inference_mode():
        lora_b.mul_(-1)  # an optimizer step changes the factors in place
        with keeper.using(adapter=True):
            changed = merged_linear(x, weight, bias, lora_a, lora_b, 0.5)
            assert prepacked(x, weight, lora_a=lora_a, lora_b=lora_b, scale=0.5) is not copy
    torch.testing.assert_close(changed, F.linear(x, weight, bias) + 0.5 * (x @ lora_a.T) @ lora_b.T, rtol=1e-5,
                               atol=1e-4)
    assert not torch.allclose(changed, merged)
    # the old version's copy was replaced, the other scale's dropped (not used in the block)
    assert keeper.held_bytes() == 2 * weight.numel() * 4
    other_a, other_b = _factors(weight, rank=2)
    with torch.inference_mode(), keeper.using(adapter=True):
        merged_linear(x, weight, bias, lora_a, lora_b, 0.5)
    assert keeper.held_bytes() == 2 * weight.numel() * 4  # kept while used
    with torch.inference_mode(), keeper.using(adapter=True):
        merged_linear(x, weight, bias, other_a, other_b, 0.5)
    assert keeper.held_bytes() == 2 * weight.numel() * 4  # another adapter's block dropped those not used in it
    del other_a
    gc.collect()
    assert keeper.held_bytes() == weight.numel() * 4  # the adapter's copies went with it; the base's stays


def test_merged_copies_only_in_fp32_and_only_inside_a_block(monkeypatch):
    x, weight, bias = _inputs()
    lora_a, lora_b = _factors(weight)
    assert merged_linear(x, weight, bias, lora_a, lora_b, 1.0) is None  # outside a block
    low = [t.to(torch.bfloat16) for t in (x, weight, bias, lora_a, lora_b)]
    keeper = PrepackedWeights()
    with torch.inference_mode(), keeper.using(adapter=True):
        assert merged_linear(*low, 1.0) is None  # bf16 would round a small update away
        monkeypatch.setenv("BIOS_GEMM", "aten")
        assert merged_linear(x, weight, bias, lora_a, lora_b, 1.0) is None
    assert keeper.held_bytes() == 0


def test_lora_layers_merge_only_when_one_adapter_has_every_row():
    from bios.worker.lora import LoraSegment, lora_forward

    x, weight, bias = _inputs(rows=8)
    lora_a, lora_b = _factors(weight)
    other_a, other_b = _factors(weight, rank=2)

    def expected(segments):
        out = F.linear(x, weight, bias)
        for s in segments:
            out[s.start:s.end] += s.scale * (x[s.start:s.end] @ s.lora_a.T) @ s.lora_b.T
        return out

    whole = [LoraSegment(0, 8, lora_a, lora_b, 2.0)]
    split = [LoraSegment(0, 3, lora_a, lora_b, 2.0), LoraSegment(3, 8, other_a, other_b, 1.0)]
    part = [LoraSegment(2, 8, lora_a, lora_b, 2.0)]
    keeper = PrepackedWeights()
    for segments, merged in ((split, False), (part, False), (whole, True)):
        with torch.inference_mode(), keeper.using(adapter=True):
            result = lora_forward(x, weight, bias, segments)
            held = keeper.held_bytes()
            prepacked(x, weight, lora_a=lora_a, lora_b=lora_b, scale=2.0)  # adds a copy unless lora_forward made it
            assert (keeper.held_bytes() == held) == merged
        torch.testing.assert_close(result, expected(segments), rtol=1e-5, atol=1e-4)
        keeper.release()


def test_bf16_rows_of_one_adapter_get_both_products_from_one_stacked_copy():
    x, weight, bias = _inputs(torch.bfloat16)
    lora_a, lora_b = _factors(weight)
    keeper = PrepackedWeights()
    with torch.inference_mode(), keeper.using():
        assert stacked_linear(x, weight, None, lora_a, lora_b, 0.5) is None  # only in blocks opened for it
    with torch.inference_mode(), keeper.using(adapter=True):
        assert stacked_linear(x, weight, bias, lora_a, lora_b, 0.5) is None  # a bias would round once more
        result = stacked_linear(x, weight, None, lora_a, lora_b, 0.5)
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():  # AVX2-only: oneDNN makes no bf16 copies
        assert result is None and keeper.held_bytes() == 0
        return
    assert keeper.held_bytes() == (weight.shape[0] + lora_a.shape[0]) * weight.shape[1] * 2
    expected = F.linear(x.float(), weight.float()) + 0.5 * (x.float() @ lora_a.float().T) @ lora_b.float().T
    plain = F.linear(x, weight).addmm_(x @ lora_a.T, lora_b.T, alpha=0.5)  # the path it replaces
    assert (result.float() - expected).abs().max() <= 1.5 * (plain.float() - expected).abs().max()
    torch.testing.assert_close(result, plain, rtol=2e-2, atol=0.25)
    from bios.worker.lora import LoraSegment, lora_forward

    with torch.inference_mode(), keeper.using(adapter=True):  # a LoRA layer's decode step takes this path
        assert torch.equal(lora_forward(x[:, None], weight, None, [LoraSegment(0, 16, lora_a, lora_b, 0.5)])[:, 0],
                           result)


def _stack_inputs(dtype, rows=16):
    """Three weights (and biases) that multiply one input, as q, k and v do."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(rows, 96, generator=generator).to(dtype)
    weights = [torch.randn(out, 96, generator=generator).to(dtype) for out in (64, 32, 32)]
    biases = [torch.randn(w.shape[0], generator=generator).to(dtype) for w in weights]
    return x, weights, biases


@pytest.mark.parametrize("intel", [False, True])
def test_weights_that_share_an_input_multiply_by_one_stacked_copy_with_each_ones_numbers(intel, monkeypatch):
    """q, k and v (gate and up) of a decode step: one product by one copy of the stacked weights gives every
    output side by side, what each weight's own copy gives, with each weight's merged update or none: bit for bit
    through oneDNN's copies, to fp32 rounding through MKL's packs (its AVX2 kernels, `MKL_ENABLE_INSTRUCTIONS=AVX2`,
    sum a wider stack in another order; its AVX-512 ones gave the same bits)."""
    from bios.kernels.frozen_matmul import frozen_product, merged_product, stacked_weights_product
    from bios.kernels.prepacked import LoraUpdate

    monkeypatch.setattr(gemm_choice, "intel_cpu", lambda: intel)
    x, weights, biases = _stack_inputs(torch.float32)
    lora_a, lora_b = _factors(weights[0])
    updates = [LoraUpdate(lora_a, lora_b, 0.5), None, LoraUpdate(*_factors(weights[2], rank=2), 2.0)]
    keeper = PrepackedWeights()
    with torch.inference_mode(), keeper.using(adapter=True, rows=16):
        stacked = stacked_weights_product(x, weights, biases, updates)(x)
        alone = [frozen_product(x, w, b)(x) if u is None else merged_product(x, w, b, *u)(x)
                 for w, b, u in zip(weights, biases, updates)]
        held = keeper.held_bytes()
        base = stacked_weights_product(x, weights, [None] * 3, [None] * 3)(x)
        copy = prepacked_module.prepacked_stack(x, weights, [None] * 3)
    assert copy is not None and isinstance(copy, MklPack) == intel
    if intel:
        torch.testing.assert_close(stacked, torch.cat(alone, dim=-1), rtol=1e-5, atol=1e-4)
    else:
        assert torch.equal(stacked, torch.cat(alone, dim=-1))
    assert held == 2 * 128 * 96 * 4  # the stacked copy as big as the three own ones together
    torch.testing.assert_close(base, torch.cat([F.linear(x, w) for w in weights], dim=-1), rtol=1e-5, atol=1e-4)
    with torch.inference_mode(), keeper.using(rows=16):  # a block not opened for adapters: no adapter copies
        assert stacked_weights_product(x, weights, biases, updates) is None
    monkeypatch.setenv("BIOS_GEMM", "aten")
    with torch.inference_mode(), keeper.using(adapter=True, rows=16):
        assert stacked_weights_product(x, weights, biases, updates) is None


def test_bf16_weights_that_share_an_input_stack_their_a_factors_after_them():
    from bios.kernels.frozen_matmul import stacked_product, stacked_weights_product
    from bios.kernels.prepacked import LoraUpdate

    x, weights, _ = _stack_inputs(torch.bfloat16)
    factors = [_factors(weights[0]), None, _factors(weights[2], rank=2)]
    updates = [None if f is None else LoraUpdate(*f, 0.5) for f in factors]
    keeper = PrepackedWeights()
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():  # AVX2-only: oneDNN makes no bf16 copies
        with torch.inference_mode(), keeper.using(adapter=True):
            assert stacked_weights_product(x, weights, [None] * 3, updates) is None
        return
    with torch.inference_mode(), keeper.using(adapter=True):
        stacked = stacked_weights_product(x, weights, [None] * 3, updates)(x)
        alone = stacked_product(x, weights[0], None, *updates[0])(x)
        with_bias = stacked_weights_product(x, weights, [weights[0][0], None, None], updates)
    assert with_bias is None  # a bias would round once more (as for one weight)
    assert keeper.held_bytes() == (128 + 4 + 2) * 96 * 2 + (64 + 4) * 96 * 2
    expected = torch.cat([F.linear(x.float(), w.float()) + (0 if u is None else
                          0.5 * (x.float() @ u.lora_a.float().T) @ u.lora_b.float().T)
                          for w, u in zip(weights, updates)], dim=-1)
    torch.testing.assert_close(stacked.float(), expected, rtol=2e-2, atol=0.5)
    torch.testing.assert_close(stacked[:, :64], alone, rtol=2e-2, atol=0.25)
