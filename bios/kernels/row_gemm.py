"""fp32 products of a decode step's few rows by a frozen weight, streamed once from memory by a small C kernel.

A decode step of 16 rows is little more than its weight products, and each weight is read from memory once per
step: the product is bound by how fast the cores stream the weight while they multiply. MKL's packed sgemm
(`prepacked.MklPack`) streams SmolLM2's layers at ~15 GB/s on a 2-core Intel Xeon whose cores read 28.8 GB/s;
one core at 8 GB/s. `csrc/row_gemm.c` lays each block of 16 output features (8 with AVX2) out as one contiguous
stream, prefetches it a few lines ahead, and keeps the rows' sums in registers: 23.0 ms against MKL's 29.1 for
the layers (18.4 vs 14.6 GB/s), 6.0 against 7.4 ms for the 49152 x 576 head; with AVX2 30.7 against 35.0 ms.
MKL stays ahead from ~64 rows (57.7 vs 48.0 ms) and at 4 (22.5 vs 20.5 ms: the kernel multiplies 16 rows
whatever the count), so the sampler takes these packs for 5 to 32 rows (`suits`).

The kernel is C (`bios.kernels.c_kernels` builds it with the machine's C compiler); where it cannot be built, or
with `BIOS_C_KERNELS=off`, the sampler keeps MKL's or oneDNN's copies.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from bios.kernels.c_kernels import CKernels, c_kernels

# The rows a decode step's product must have for these packs to beat MKL's (module docstring).
MIN_ROWS, MAX_ROWS = 5, 32


def suits(rows: int) -> bool:
    """Whether products of up to `rows` rows should multiply by `RowGemmPack`s: the kernels are built (or build
    now) and allowed, and the rows are in the range where this one beats MKL."""
    return MIN_ROWS <= rows <= MAX_ROWS and c_kernels() is not None


class RowGemmPack(NamedTuple):
    """A weight [out, in] (or several stacked, or `W + scale·B·A`) laid out for the kernel: [blocks, in, width]."""

    packed: torch.Tensor
    out_features: int
    kernels: CKernels

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`x Wᵀ + b` for fp32 x [..., in]."""
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise TypeError(f"RowGemmPack multiplies fp32 CPU tensors, got {x.dtype} on {x.device}")
        flat = x if x.dim() == 2 and x.stride(1) == 1 else x.reshape(-1, x.shape[-1])
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        out = flat.new_empty(flat.shape[0], self.out_features)
        if bias is not None:
            bias = bias.to(torch.float32).contiguous()
        self.kernels.library.bios_row_gemm(
            flat.data_ptr(), flat.stride(0), self.packed.data_ptr(), None if bias is None else bias.data_ptr(),
            out.data_ptr(), self.out_features, flat.shape[0], flat.shape[1], self.out_features,
            torch.get_num_threads())
        return out if flat is x else out.reshape(*x.shape[:-1], self.out_features)


def pack(weight: torch.Tensor) -> RowGemmPack:
    """`weight` [out, in] (fp32, CPU) laid out for the kernel, out rounded up to its width with zero rows."""
    kernels = c_kernels()
    width = kernels.width
    out_features, in_features = weight.shape
    blocks = -(-out_features // width)
    padded = weight.new_zeros(blocks * width, in_features)
    padded[:out_features] = weight
    return RowGemmPack(padded.view(blocks, width, in_features).transpose(1, 2).contiguous(), out_features, kernels)
