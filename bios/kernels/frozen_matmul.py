"""The two matmuls against a frozen base weight W [out, in]: `x Wᵀ (+ b)` forward and `g W` for the input's
gradient, on the faster of the CPU's two GEMM libraries.

PyTorch's CPU build sends fp32 matmuls to MKL's sgemm and bf16 ones to oneDNN. On an AMD EPYC (AVX-512,
torch 2.13.0+cpu, 2 threads) oneDNN's fp32 GEMM ran 1.1-1.2x MKL's on a training step's shapes (512 x 1536 x
576: 207 vs 178 GFLOP/s; 2048^3: 212 vs 177) and 1.2-2.3x on a decode step's few rows (16 rows through
SmolLM2's 49152 x 576 head: 103 vs 44 GFLOP/s), also with oneDNN held to AVX2; bf16 runs oneDNN either way.
So fp32 CPU tensors go through oneDNN's linear (`torch.ops.mkldnn._linear_pointwise`, the op Inductor uses for
CPU linear layers), except a few rows through a small weight, where MKL's lower call cost wins; everything else
(GPUs, bf16, a build without oneDNN) through `torch.nn.functional.linear` and `torch.mm` as before. Results
agree to fp32 rounding (another summation order).

`BIOS_GEMM=aten` keeps PyTorch's own choice everywhere (read per call, like `BIOS_KERNELS`, so one process can
time both; `bench/gemm.py` compares them shape by shape). These are plain functions without autograd: their
callers are `torch.autograd.Function` forwards and backwards, and no-grad code.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

_BACKENDS = ("onednn", "aten")


def gemm_backend() -> str:
    """`BIOS_GEMM` (unset: "onednn"): which library fp32 CPU matmuls against frozen weights use."""
    value = os.environ.get("BIOS_GEMM", "").strip().lower() or "onednn"
    if value not in _BACKENDS:
        raise ValueError(f"BIOS_GEMM must be one of {list(_BACKENDS)} (unset: onednn), got {value!r}")
    return value


# Below both, oneDNN's call costs more than it saves (16 rows through a 576 -> 192 projection: 0.74x; 1 row: 0.51x).
_ONEDNN_MIN_ROWS = 32
_ONEDNN_MIN_WEIGHT = 1 << 19  # elements


def gemm_library(weight: torch.Tensor) -> str:
    """Which library multiplies by `weight` (a frozen base weight) in training passes, for the worker's log."""
    if weight.device.type != "cpu":
        return f"PyTorch's {weight.device.type} matmul"
    if weight.dtype == torch.float32 and torch.backends.mkldnn.is_available() and gemm_backend() == "onednn":
        return "oneDNN (BIOS_GEMM=aten keeps PyTorch's MKL)"
    return "PyTorch's CPU matmul (oneDNN for bf16, MKL for fp32)"


def _onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (gemm_backend() == "onednn" and x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
            and (x.numel() >= _ONEDNN_MIN_ROWS * x.shape[-1] or weight.numel() >= _ONEDNN_MIN_WEIGHT)
            and torch.backends.mkldnn.is_available())


def frozen_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """`x Wᵀ + b` for x [..., in], weight [out, in] (any strides), bias [out] or None; into `out` if given
    (oneDNN's op has no out= form: its result is copied, which costs less than its gain on a head's chunk)."""
    if _onednn(x, weight):
        result = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return result if out is None else out.copy_(result)
    if out is None:
        return F.linear(x, weight, bias)
    return torch.addmm(bias, x, weight.T, out=out) if bias is not None else torch.mm(x, weight.T, out=out)


def frozen_input_grad(grad: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """`grad W` for grad [rows, out], weight [out, in]: the gradient of `x Wᵀ` with respect to x."""
    if _onednn(grad, weight):
        result = torch.ops.mkldnn._linear_pointwise(grad, weight.T, None, "none", [], "")
        return result if out is None else out.copy_(result)
    return torch.mm(grad, weight, out=out) if out is not None else grad @ weight
