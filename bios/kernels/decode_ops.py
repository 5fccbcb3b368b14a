"""A decode step's small per-layer steps in fp32 on CPU, one C call each (`csrc/decode_ops.c`).

A decode step streams every weight through the caches, so each small op between two products runs cold, and the
dispatch of a PyTorch op then costs far more than its arithmetic: SmolLM2's 16 x 576 RMSNorm takes 12 us alone
and ~50 in a decode step. The lean decode step (`bios.worker.llama_decode`) takes these instead where Bios's C
kernels are built (`DecodeOps.for_hidden`): a residual add fused with the next RMSNorm, RoPE in place (bit for bit
PyTorch's), SwiGLU. SmolLM2 fp32, 16 x 64 (Intel Xeon, 2 threads): removing the norms, RoPE and SwiGLU altogether
would save 6.1 of 44.8 ms a step; these calls take 2.5 ms of it (norms 3.2 -> 1.1, RoPE 1.1 -> 0.4, SwiGLU 1.5 ->
1.0), and the step went 46 -> 40 ms.
"""

from __future__ import annotations

import torch
from torch import Tensor

from bios.kernels.c_kernels import CKernels, c_kernels


class DecodeOps:
    """The C versions of a decode step's norms, RoPE and SwiGLU, for fp32 CPU tensors whose last dim is
    contiguous."""

    def __init__(self, kernels: CKernels) -> None:
        self._library = kernels.library

    @classmethod
    def for_hidden(cls, hidden_dtype: torch.dtype, device: torch.device) -> DecodeOps | None:
        """The ops for a decode step whose hidden states are `hidden_dtype` on `device`; None where PyTorch's run
        (not fp32 on CPU, or no C kernels here)."""
        kernels = c_kernels() if hidden_dtype == torch.float32 and device.type == "cpu" else None
        return None if kernels is None else cls(kernels)

    def add_rms_norm(self, hidden: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> Tensor:
        """`hidden += delta` in place (if given), then RMSNorm(hidden) * weight, as a new tensor. hidden [rows, n]."""
        rows, width = hidden.shape
        _check(hidden, weight, *(() if delta is None else (delta,)))
        out = hidden.new_empty(rows, width)
        self._library.bios_add_rms_norm(hidden.data_ptr(), hidden.stride(0),
                                        None if delta is None else delta.data_ptr(),
                                        0 if delta is None else delta.stride(0), weight.data_ptr(), out.data_ptr(),
                                        width, None, rows, width, eps, 1)
        return out

    def rotate(self, x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
        """RoPE in place on x [rows, heads, d] (rows may be strided; heads and d contiguous): x·cos +
        rotate_half(x)·sin, sin's first half negated (`signed_sin`), cos/sin [rows, 1, d]; returns x. The same
        numbers as PyTorch's ops, bit for bit."""
        rows, heads, width = x.shape
        if x.stride(2) != 1 or x.stride(1) != width:
            raise ValueError(f"rotate_: heads and positions must be contiguous, got strides {x.stride()}")
        cos, signed_sin = cos.contiguous(), signed_sin.contiguous()
        _check(x, cos, signed_sin)
        self._library.bios_rotate(x.data_ptr(), x.stride(0), x.data_ptr(), x.stride(0), rows, heads, width,
                                  cos.data_ptr(), signed_sin.data_ptr(), 1)
        return x

    def swiglu(self, gate_up: Tensor, intermediate: int) -> Tensor:
        """silu(gate) * up for gate_up [rows, 2 x intermediate] (gate, then up) -> [rows, intermediate]."""
        _check(gate_up)
        rows = gate_up.shape[0]
        out = gate_up.new_empty(rows, intermediate)
        self._library.bios_swiglu(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, intermediate, 1)
        return out


def _check(*tensors: Tensor) -> None:
    for tensor in tensors:
        if tensor.dtype != torch.float32 or tensor.device.type != "cpu" or tensor.stride(-1) != 1:
            raise ValueError(f"decode ops take fp32 CPU tensors with a contiguous last dim, got {tensor.dtype} on "
                             f"{tensor.device}, strides {tensor.stride()}")
