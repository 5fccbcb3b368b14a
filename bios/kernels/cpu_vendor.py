"""Whose CPU this is, for the choice between its two GEMM libraries: MKL picks its kernels by the CPU's vendor and
runs its fastest on Intel's, where oneDNN's fp32 GEMM wins on AMD's (`bios.kernels.frozen_matmul`,
`bios.kernels.prepacked`)."""

from __future__ import annotations

from functools import cache
from pathlib import Path


@cache
def intel_cpu() -> bool:
    """Whether this is an Intel CPU (`vendor_id` GenuineIntel in /proc/cpuinfo); False where it does not say."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return False
    vendors = {line.split(":", 1)[1].strip() for line in lines if line.startswith("vendor_id")}
    return vendors == {"GenuineIntel"}
