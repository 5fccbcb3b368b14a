"""The fp32 row kernel for decode steps (bios.kernels.row_gemm): it multiplies a few rows by a packed weight with
PyTorch's numbers to fp32 rounding, each column's result independent of the other weights stacked with it; the
sampler's copies for 5 to 32 rows are its packs. Without Bios's C kernels (no compiler, `BIOS_C_KERNELS=off`) the
copies are MKL's or oneDNN's as before."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from bios.kernels import c_kernels, gemm_choice, row_gemm
from bios.kernels.frozen_matmul import frozen_linear, merged_product, stacked_weights_product
from bios.kernels.prepacked import LoraUpdate, MklPack, PrepackedWeights, prepacked, prepacked_stack
from bios.kernels.row_gemm import RowGemmPack

needs_compiler = pytest.mark.skipif(c_kernels.c_compiler() is None,
                                    reason="no C compiler here: the row kernel is not built (its fallback is tested)")


@pytest.fixture(autouse=True)
def _settings(monkeypatch):
    for name in ("BIOS_C_KERNELS", "BIOS_PREPACK", "BIOS_GEMM"):
        monkeypatch.delenv(name, raising=False)
    c_kernels._loaded.cache_clear()
    yield
    c_kernels._loaded.cache_clear()  # the next test builds (or finds in the cache) under its own settings


def _weights(out, inputs, rows, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, inputs, generator=generator), torch.randn(out, inputs, generator=generator),
            torch.randn(out, generator=generator))


@needs_compiler
@pytest.mark.parametrize("rows", [1, 5, 8, 16, 17, 33])
@pytest.mark.parametrize("out,inputs", [(200, 96), (33, 17), (16, 1536)])
def test_the_kernel_multiplies_a_few_rows_as_pytorch_does(rows, out, inputs):
    x, weight, bias = _weights(out, inputs, rows)
    packed = row_gemm.pack(weight)
    assert isinstance(packed, RowGemmPack) and packed.out_features == out
    torch.testing.assert_close(packed.linear(x, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(packed.linear(x), x @ weight.T, rtol=1e-5, atol=1e-4)
    wide = torch.randn(rows, inputs + 7)[:, 3 : 3 + inputs]  # rows of a wider tensor (a row stride of its own)
    torch.testing.assert_close(packed.linear(wide), F.linear(wide, weight), rtol=1e-5, atol=1e-4)
    batched = packed.linear(x[:, None, :], bias)
    assert batched.shape == (rows, 1, out) and torch.equal(batched[:, 0], packed.linear(x, bias))
    with pytest.raises(TypeError, match="fp32 CPU tensors, got torch.bfloat16"):
        packed.linear(x.bfloat16())


@needs_compiler
def test_a_stack_of_weights_gives_each_weights_own_numbers_bit_for_bit():
    x, _, _ = _weights(1, 96, 16)
    weights = [torch.randn(out, 96) for out in (64, 40, 24)]  # 40: a block shared by two weights
    stacked = row_gemm.pack(torch.cat(weights)).linear(x)
    assert torch.equal(stacked, torch.cat([row_gemm.pack(w).linear(x) for w in weights], dim=-1))


def test_without_a_compiler_decode_products_keep_mkl_or_onednn_copies(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("BIOS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert not row_gemm.suits(16)
    for intel in (False, True):
        monkeypatch.setattr(gemm_choice, "intel_cpu", lambda: intel)
        x, weight, bias = _weights(200, 96, 16)
        with torch.inference_mode(), PrepackedWeights().using(rows=16):
            copy = prepacked(x, weight)
            result = frozen_linear(x, weight, bias)
        assert isinstance(copy, MklPack) if intel else copy.is_mkldnn
        torch.testing.assert_close(result, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


@needs_compiler
def test_the_setting_turns_it_off(monkeypatch):
    assert row_gemm.suits(16)
    monkeypatch.setenv("BIOS_C_KERNELS", "off")
    assert not row_gemm.suits(16)


@needs_compiler
@pytest.mark.parametrize("intel", [False, True])
def test_the_samplers_fp32_copies_for_5_to_32_rows_are_row_kernel_packs(intel, monkeypatch):
    monkeypatch.setattr(gemm_choice, "intel_cpu", lambda: intel)
    x, weight, bias = _weights(200, 96, 40)
    keeper = PrepackedWeights()
    kinds = {}
    for rows in (4, 5, 16, 32, 33):
        with torch.inference_mode(), keeper.using(rows=rows):
            kinds[rows] = type(prepacked(x[:rows], weight))
            torch.testing.assert_close(frozen_linear(x[:rows], weight, bias), F.linear(x[:rows], weight, bias),
                                       rtol=1e-5, atol=1e-4)
    other = MklPack if intel else torch.Tensor
    assert kinds == {4: other, 5: RowGemmPack, 16: RowGemmPack, 32: RowGemmPack, 33: other}
    generator = torch.Generator().manual_seed(3)
    lora_a, lora_b = torch.randn(4, 96, generator=generator), torch.randn(200, 4, generator=generator)
    with torch.inference_mode(), keeper.using(adapter=True, rows=16):  # one adapter on every row: merged copies
        merged = merged_product(x[:16], weight, bias, lora_a, lora_b, 0.5)(x[:16])
        assert isinstance(prepacked(x[:16], weight, lora_a=lora_a, lora_b=lora_b, scale=0.5), RowGemmPack)
    torch.testing.assert_close(merged, F.linear(x[:16], weight, bias) + 0.5 * (x[:16] @ lora_a.T) @ lora_b.T,
                               rtol=1e-5, atol=1e-4)
    weights = [weight[:64], weight[64:96], weight[96:128]]  # q, k and v: one stacked copy, each one's numbers
    updates = [LoraUpdate(lora_a, lora_b[:64], 0.5), None, None]
    with torch.inference_mode(), keeper.using(adapter=True, rows=16):
        stacked = stacked_weights_product(x[:16], weights, [None] * 3, updates)(x[:16])
        assert isinstance(prepacked_stack(x[:16], weights, updates), RowGemmPack)
        alone = [merged_product(x[:16], weights[0], None, lora_a, lora_b[:64], 0.5)(x[:16]),
                 frozen_linear(x[:16], weights[1]), frozen_linear(x[:16], weights[2])]
    assert torch.equal(stacked, torch.cat(alone, dim=-1))
