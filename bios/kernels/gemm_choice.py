"""What picks the library that multiplies fp32 frozen weights on CPU (`bios.kernels.frozen_matmul` for plain
weights, `bios.kernels.prepacked` for a decode step's copies): the `BIOS_GEMM` setting and the CPU's vendor. MKL
picks its kernels by the vendor and runs its fastest on Intel's CPUs, where oneDNN's fp32 GEMM wins on AMD's.

`BIOS_GEMM` (read per call, like `BIOS_KERNELS`, so one process can time both) is `auto` (unset: the rules of
those two modules), `onednn` (every fp32 CPU product, for a machine where `bench/gemm.py`, which compares them
shape by shape, says so) or `aten` (PyTorch's own choice everywhere, no prepacked copies).
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

_SETTINGS = ("auto", "onednn", "aten")


def gemm_backend() -> str:
    """`BIOS_GEMM` (unset: "auto"); ValueError on a value that is not a setting."""
    value = os.environ.get("BIOS_GEMM", "").strip().lower() or "auto"
    if value not in _SETTINGS:
        raise ValueError(f"BIOS_GEMM must be one of {list(_SETTINGS)} (unset: auto), got {value!r}")
    return value


@cache
def intel_cpu() -> bool:
    """Whether this is an Intel CPU (`vendor_id` GenuineIntel in /proc/cpuinfo); False where it does not say."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return False
    vendors = {line.split(":", 1)[1].strip() for line in lines if line.startswith("vendor_id")}
    return vendors == {"GenuineIntel"}
