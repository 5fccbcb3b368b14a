"""How the worker computes, read from the environment: fused kernels (`BIOS_KERNELS`), packed training rows
(`BIOS_PACKING`) and the dtype of the frozen base weights (`BIOS_BASE_DTYPE`).

`BIOS_KERNELS` (default on) decides at every call whether the worker's layers run `bios.kernels` or the
stock Transformers/PyTorch ops (and at every sampling call whether a Llama-family decode runs the lean step of
`bios.worker.llama_decode` or the model's own modules); `BIOS_PACKING` (default on) whether a training pass
packs its rows end to end (`bios.worker.packing`) or pads them to the longest. Both are read per call rather
than once so one process can compare both paths. (`BIOS_GEMM`, which GEMM library fp32 matmuls on CPU use, is read by the kernels
themselves: `bios.kernels.frozen_matmul`.)

`BIOS_BASE_DTYPE` is read when a base model is prepared (`attach_lora`). `float32` or `bfloat16` stores the
frozen base weights (and so the activations) in that dtype; adapters, their gradients and the optimizer stay
fp32 either way. Unset, the base goes to bf16 where the hardware multiplies bf16 natively (a CPU with
avx512_bf16 or AMX running AVX-512 code, a CUDA GPU with native bf16) and keeps its loaded dtype elsewhere:
there, bf16 is emulated and slower than fp32. `BIOS_C_ISA=avx2` makes an AVX-512 CPU choose as an AVX2-only one
(`bios.kernels.c_kernels.c_isa`). On SmolLM2-135M with the fused kernels, bf16 on an avx512_bf16 CPU makes a training
step 2.2x faster than fp32 with 0.73x the peak memory (bench/README.md), at bf16 rounding of the activations.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from bios.kernels.c_kernels import c_isa

_ON = ("", "1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")
_BASE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_CPU_BF16_FEATURES = ("amx_bf16", "avx512_bf16")


def _switch(name: str, on: str, off: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"{name} must be 1 ({on}, the default) or 0 ({off}), got {value!r}")


def kernels_enabled() -> bool:
    """Whether `BIOS_KERNELS` (unset: on) asks for the fused kernels; ValueError on a value that is neither."""
    return _switch("BIOS_KERNELS", "fused kernels", "stock PyTorch ops")


def packing_enabled() -> bool:
    """Whether `BIOS_PACKING` (unset: on) asks for packed training rows; ValueError on a value that is neither."""
    return _switch("BIOS_PACKING", "rows packed end to end", "rows padded to the longest")


@dataclass(frozen=True)
class BaseDtype:
    """The dtype frozen base weights are stored in on one device, and why (for logs)."""

    dtype: torch.dtype | None  # None: keep the dtype the model was loaded in
    reason: str


def native_bf16(device: torch.device) -> str | None:
    """The hardware feature that runs bf16 matmuls natively on `device` (e.g. "avx512_bf16"), None if none does."""
    if device.type == "cuda":
        return "CUDA bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else None
    if device.type == "cpu":  # AVX-512 code only: under BIOS_C_ISA=avx2 (or ATEN_CPU_CAPABILITY=avx2) it is emulated
        if c_isa() != "AVX512":
            return None
        capabilities = torch.cpu.get_capabilities()
        return next((feature for feature in _CPU_BF16_FEATURES if capabilities.get(feature)), None)
    return None


def base_dtype(device: torch.device) -> BaseDtype:
    """What `BIOS_BASE_DTYPE` asks for, or unset, bf16 where `device` has `native_bf16` (else keep as loaded).

    ValueError on a value that is not a known dtype.
    """
    value = os.environ.get("BIOS_BASE_DTYPE", "").strip().lower()
    if value:
        if value not in _BASE_DTYPES:
            raise ValueError(f"BIOS_BASE_DTYPE must be one of {sorted(_BASE_DTYPES)} (or unset), got {value!r}")
        return BaseDtype(_BASE_DTYPES[value], f"BIOS_BASE_DTYPE={value}")
    feature = native_bf16(device)
    if feature is None:
        return BaseDtype(None, f"no native bf16 matmul on {device.type}; BIOS_BASE_DTYPE=bfloat16 forces it")
    return BaseDtype(torch.bfloat16, f"{feature} on {device.type}; BIOS_BASE_DTYPE=float32 keeps fp32")
