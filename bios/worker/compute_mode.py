"""How the worker computes, read from the environment: fused kernels (`BIOS_KERNELS`) and the base dtype
(`BIOS_BASE_DTYPE`).

`BIOS_KERNELS` (default on) decides at every call whether the worker's layers run `bios.kernels` or the
stock Transformers/PyTorch ops; it is read per call rather than once so one process can compare both paths.
`BIOS_BASE_DTYPE` is read when a base model is prepared (`attach_lora`): unset keeps the dtype the model
was loaded in (float32), `bfloat16` stores the frozen base weights in bf16 while adapters, their gradients
and the optimizer stay fp32. On CPUs with avx512_bf16 and on GPUs that halves memory and roughly doubles the
speed of a SmolLM2-135M step (bench/training_step.py), at bf16 rounding of the activations.
"""

from __future__ import annotations

import os

import torch

_ON = ("", "1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")
_BASE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def kernels_enabled() -> bool:
    """Whether `BIOS_KERNELS` (unset: on) asks for the fused kernels; ValueError on a value that is neither."""
    value = os.environ.get("BIOS_KERNELS", "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"BIOS_KERNELS must be 1 (fused kernels, the default) or 0 (stock PyTorch ops), got {value!r}")


def base_dtype() -> torch.dtype | None:
    """The dtype `BIOS_BASE_DTYPE` asks frozen base weights to be stored in; None when unset (keep as loaded)."""
    value = os.environ.get("BIOS_BASE_DTYPE", "").strip().lower()
    if not value:
        return None
    if value not in _BASE_DTYPES:
        raise ValueError(f"BIOS_BASE_DTYPE must be one of {sorted(_BASE_DTYPES)} (or unset), got {value!r}")
    return _BASE_DTYPES[value]
