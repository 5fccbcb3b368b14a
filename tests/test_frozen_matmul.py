"""Matmuls against frozen base weights (bios.kernels.frozen_matmul): fp32 on CPU runs oneDNN's GEMM where it
measured faster (`BIOS_GEMM=auto`), everywhere (`onednn`) or nowhere (`aten`); both libraries are fp32-accurate,
and a whole training pass agrees between them to fp32 rounding. Each test pins the setting it needs, so its
meaning does not depend on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_kernel_integration import random_batch, smollm2_shaped
from torch.utils._python_dispatch import TorchDispatchMode

from bios.kernels import gemm_choice
from bios.kernels.gemm_choice import intel_cpu
from bios.kernels.frozen_matmul import frozen_input_grad, frozen_linear, gemm_backend, gemm_library
from bios.types import LoraConfig
from bios.worker.adapter import AdapterState
from bios.worker.engine import ForwardItem, forward_backward
from bios.worker.lora import attach_lora


class Ops(TorchDispatchMode):
    """The names of the ops that run inside the block."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _inputs(dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(37, 96, generator=generator).to(dtype)
    weight = torch.randn(200, 96, generator=generator).to(dtype)
    bias = torch.randn(200, generator=generator).to(dtype)
    grad = torch.randn(37, 200, generator=generator).to(dtype)
    return x, weight, bias, grad


@pytest.mark.parametrize("backend", ["onednn", "aten"])
def test_both_gemms_compute_x_wt_and_g_w_in_fp32(backend, monkeypatch):
    monkeypatch.setenv("BIOS_GEMM", backend)
    x, weight, bias, grad = _inputs()
    exact_forward = x.double() @ weight.double().T + bias.double()
    exact_grad = grad.double() @ weight.double()
    transposed = weight.T.contiguous().T  # a Conv1D's weight: [out, in] seen through a transpose
    with Ops() as ops:
        results = [frozen_linear(x, weight, bias), frozen_linear(x, transposed, bias),
                   frozen_linear(x, weight, bias, out=torch.empty(37, 200)), frozen_input_grad(grad, weight),
                   frozen_input_grad(grad, transposed), frozen_input_grad(grad, weight, out=torch.empty(37, 96))]
    for got, want in zip(results, [exact_forward] * 3 + [exact_grad] * 3):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-4)  # fp32 sums of 96 or 200 terms
    assert ("mkldnn._linear_pointwise" in ops.names) == (backend == "onednn" and torch.backends.mkldnn.is_available())


def _uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    with Ops() as ops:
        frozen_linear(x, weight)
    return "mkldnn._linear_pointwise" in ops.names


@pytest.mark.parametrize("intel", [False, True])
def test_auto_takes_onednn_where_it_measured_faster_and_bad_settings_are_refused(intel, monkeypatch):
    monkeypatch.delenv("BIOS_GEMM", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(gemm_choice, "intel_cpu", lambda: intel)
    assert gemm_backend() == "auto"
    onednn = torch.backends.mkldnn.is_available()
    generator = torch.Generator().manual_seed(0)
    small, wide = torch.randn(200, 96, generator=generator), torch.randn(1024, 512, generator=generator)
    assert not _uses_onednn(torch.randn(4, 96), small)  # a decode step's rows through a small projection
    # ... through a wide one (a head), and a training pass's rows where oneDNN runs AVX-512; on Intel's CPUs MKL
    # runs its own best kernels for both
    assert _uses_onednn(torch.randn(4, 512), wide) == (onednn and not intel)
    avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
    assert _uses_onednn(torch.randn(100, 96), small) == (onednn and avx512 and not intel)
    assert gemm_library(small).startswith("oneDNN") == (onednn and avx512 and not intel)
    assert gemm_library(small).startswith("MKL, on an Intel CPU") == intel
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # oneDNN held to AVX2: training products stay on MKL
    assert not _uses_onednn(torch.randn(100, 96), small)
    assert gemm_library(small).endswith("wide products and a head's logits (BIOS_GEMM=onednn: oneDNN for all)") == (
        onednn and not intel)
    assert not _uses_onednn(torch.randn(100, 96, dtype=torch.bfloat16), small.bfloat16())  # bf16: PyTorch's
    assert gemm_library(small.bfloat16()).startswith("PyTorch's CPU matmul")  # what the worker logs
    assert gemm_library(small).startswith("MKL, and oneDNN for a decode step's wide products") == (onednn and not intel)
    monkeypatch.setenv("BIOS_GEMM", "onednn")
    assert gemm_library(small).startswith("oneDNN") == onednn
    monkeypatch.setenv("BIOS_GEMM", "aten")
    assert gemm_library(small).startswith("PyTorch's CPU matmul")
    monkeypatch.setenv("BIOS_GEMM", "mkl")
    with pytest.raises(ValueError, match=r"BIOS_GEMM must be one of \['auto', 'onednn', 'aten'\] \(unset: auto\), "
                                         r"got 'mkl'"):
        frozen_linear(*_inputs()[:2])


@pytest.mark.parametrize("isa", ["", "AVX2"])
def test_a_wide_product_into_a_buffer_goes_to_onednn_block_by_block(isa, monkeypatch):
    """A head's logits for the loss off Intel's CPUs: oneDNN on either instruction set, in blocks of output
    features (the last one partial), each copied into the caller's buffer; the same numbers as one product."""
    monkeypatch.delenv("BIOS_GEMM", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    monkeypatch.setattr(gemm_choice, "intel_cpu", lambda: False)
    generator = torch.Generator().manual_seed(0)
    x, bias = torch.randn(100, 32, generator=generator), torch.randn(4 * 4096 + 5, generator=generator)
    head = torch.randn(4 * 4096 + 5, 32, generator=generator)
    buffer = torch.full((100, head.shape[0]), float("nan"))
    with Ops() as ops:
        result = frozen_linear(x, head, bias, out=buffer)
    assert result is buffer
    assert ("mkldnn._linear_pointwise" in ops.names) == torch.backends.mkldnn.is_available()
    torch.testing.assert_close(buffer.double(), x.double() @ head.double().T + bias.double(), rtol=0, atol=1e-4)
    assert _uses_onednn(x, head) == (torch.backends.mkldnn.is_available() and isa == ""
                                     and torch.backends.cpu.get_cpu_capability() == "AVX512")  # no buffer: the rule


def test_on_an_intel_cpu_a_wide_product_into_a_buffer_stays_on_mkl(monkeypatch):
    """There MKL's sgemm into the buffer measured faster than oneDNN's blocks (module docstring)."""
    monkeypatch.delenv("BIOS_GEMM", raising=False)
    monkeypatch.setattr(gemm_choice, "intel_cpu", lambda: True)
    generator = torch.Generator().manual_seed(0)
    x, head = torch.randn(100, 32, generator=generator), torch.randn(4 * 4096 + 5, 32, generator=generator)
    buffer = torch.full((100, head.shape[0]), float("nan"))
    with Ops() as ops:
        assert frozen_linear(x, head, out=buffer) is buffer
    assert "mkldnn._linear_pointwise" not in ops.names
    torch.testing.assert_close(buffer.double(), x.double() @ head.double().T, rtol=0, atol=1e-4)


def test_intel_cpu_reads_the_vendor_once():
    vendors = {line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
               if line.startswith("vendor_id")} if Path("/proc/cpuinfo").exists() else set()
    assert intel_cpu() == (vendors == {"GenuineIntel"})
    assert intel_cpu.cache_info().currsize == 1


def adapted_smollm2_shaped(monkeypatch):
    """A 2-layer SmolLM2-shaped model in fp32 with a rank-8 adapter whose A and B are both non-zero, and a batch."""
    monkeypatch.setenv("BIOS_BASE_DTYPE", "float32")
    model = smollm2_shaped()
    attach_lora(model)
    adapter = AdapterState.create("run", model, LoraConfig(rank=8, seed=0), device="cpu")
    with torch.no_grad():
        adapter.params.add_(0.01 * torch.randn(adapter.params.shape, generator=torch.Generator().manual_seed(1)))
    return model, adapter, random_batch(model.config.vocab_size, [14, 9, 20], seed=1)


def test_a_training_pass_agrees_between_the_two_gemms(monkeypatch):
    """SmolLM2's shapes, fp32: log-probs and the adapter's gradient through either GEMM agree to fp32 rounding."""
    model, adapter, data = adapted_smollm2_shaped(monkeypatch)
    results = {}
    for backend in ("onednn", "aten"):
        monkeypatch.setenv("BIOS_GEMM", backend)
        adapter.pending_grad.zero_()
        output = forward_backward(model, [ForwardItem(adapter, data, "cross_entropy")])[0]
        results[backend] = ([out["logprobs"].to_torch() for out in output.loss_fn_outputs],
                            adapter.pending_grad.clone())
    (fast_logprobs, fast_grad), (aten_logprobs, aten_grad) = results["onednn"], results["aten"]
    for fast, aten in zip(fast_logprobs, aten_logprobs):
        torch.testing.assert_close(fast, aten, rtol=1e-5, atol=1e-5)
    assert float(aten_grad.abs().max()) > 0
    torch.testing.assert_close(fast_grad, aten_grad, rtol=0, atol=1e-5 * float(aten_grad.abs().max()))
