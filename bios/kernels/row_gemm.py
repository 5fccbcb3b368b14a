"""fp32 products of a decode step's few rows by a frozen weight, streamed once from memory by a small C kernel.

A decode step of 16 rows is little more than its weight products, and each weight is read from memory once per
step: the product is bound by how fast the cores stream the weight while they multiply. MKL's packed sgemm
(`prepacked.MklPack`) streams SmolLM2's layers at ~15 GB/s on a 2-core Intel Xeon whose cores read 28.8 GB/s;
one core at 8 GB/s. `csrc/row_gemm.c` lays each block of 16 output features (8 with AVX2) out as one contiguous
stream, prefetches it a few lines ahead, and keeps the rows' sums in registers: 23.0 ms against MKL's 29.1 for
the layers (18.4 vs 14.6 GB/s), 6.0 against 7.4 ms for the 49152 x 576 head; with AVX2 30.7 against 35.0 ms.
MKL stays ahead from ~64 rows (57.7 vs 48.0 ms) and at 4 (22.5 vs 20.5 ms: the kernel multiplies 16 rows
whatever the count), so the sampler takes these packs for 5 to 32 rows (`suits`).

The kernel is C, not PyTorch, built on first use with the machine's C compiler (`$CC`, else `cc`; -O3, OpenMP,
AVX-512 or AVX2+FMA as PyTorch's CPU capability says, so `ATEN_CPU_CAPABILITY=avx2` builds the AVX2 kernel)
into `<bios cache>/kernels/`, keyed by the source and flags. Without a compiler, on other CPUs, or with
`BIOS_ROW_GEMM=off`, nothing changes: the sampler keeps MKL's or oneDNN's copies (the worker logs why once).
Its OpenMP is PyTorch's: loaded after torch, the kernel's `libgomp.so.1` resolves to the copy torch loaded, so
both share one thread pool, sized per call to `torch.get_num_threads()`.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import NamedTuple

import torch

from bios.cache_dir import cache_dir

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "row_gemm.c"
# The rows a decode step's product must have for these packs to beat MKL's (module docstring).
MIN_ROWS, MAX_ROWS = 5, 32
_ISA_FLAGS = {"AVX512": (16, ["-mavx512f", "-mavx512vl", "-mavx2", "-mfma"]), "AVX2": (8, ["-mavx2", "-mfma"])}


def row_gemm_setting() -> str:
    """`BIOS_ROW_GEMM` (unset: "auto"): whether fp32 decode products may use this kernel."""
    value = os.environ.get("BIOS_ROW_GEMM", "").strip().lower() or "auto"
    if value not in ("auto", "off"):
        raise ValueError(f"BIOS_ROW_GEMM must be 'auto' or 'off' (unset: auto), got {value!r}")
    return value


def suits(rows: int) -> bool:
    """Whether products of up to `rows` rows should multiply by `RowGemmPack`s: the kernel is built (or builds
    now) and the rows are in the range where it beats MKL."""
    return MIN_ROWS <= rows <= MAX_ROWS and row_gemm_setting() == "auto" and _kernel() is not None


class RowGemmPack(NamedTuple):
    """A weight [out, in] (or several stacked, or `W + scale·B·A`) laid out for the kernel: [blocks, in, width]."""

    packed: torch.Tensor
    out_features: int

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`x Wᵀ + b` for fp32 x [..., in]."""
        flat = x if x.dim() == 2 and x.stride(1) == 1 else x.reshape(-1, x.shape[-1])
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        out = flat.new_empty(flat.shape[0], self.out_features)
        if bias is not None and bias.stride(0) != 1:
            bias = bias.contiguous()
        _kernel().multiply(flat.data_ptr(), flat.stride(0), self.packed.data_ptr(),
                           None if bias is None else bias.data_ptr(), out.data_ptr(), self.out_features,
                           flat.shape[0], flat.shape[1], self.out_features, torch.get_num_threads())
        return out if flat is x else out.reshape(*x.shape[:-1], self.out_features)


def pack(weight: torch.Tensor) -> RowGemmPack:
    """`weight` [out, in] (fp32, CPU) laid out for the kernel, out rounded up to its width with zero rows."""
    width = _kernel().width
    out_features, in_features = weight.shape
    blocks = -(-out_features // width)
    padded = weight.new_zeros(blocks * width, in_features)
    padded[:out_features] = weight
    return RowGemmPack(padded.view(blocks, width, in_features).transpose(1, 2).contiguous(), out_features)


class _Kernel(NamedTuple):
    multiply: ctypes._CFuncPtr
    width: int


@cache
def _kernel() -> _Kernel | None:
    """The built kernel, loaded; None (logged once) where it cannot be built here."""
    capability = torch.backends.cpu.get_cpu_capability()
    if platform.machine().lower() not in ("x86_64", "amd64") or capability not in _ISA_FLAGS:
        log.info("fp32 decode products stay on MKL/oneDNN: the row kernel needs an x86 CPU with AVX2 (this is %s, "
                 "PyTorch's capability %s)", platform.machine(), capability)
        return None
    width, isa = _ISA_FLAGS[capability]
    try:
        library = ctypes.CDLL(str(_build(width, isa)))
    except (OSError, subprocess.SubprocessError) as error:
        log.warning("fp32 decode products stay on MKL/oneDNN: could not build bios/kernels/csrc/row_gemm.c (%s)",
                    error)
        return None
    multiply = library.bios_row_gemm
    multiply.restype = None
    multiply.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                         ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    assert library.bios_row_gemm_width() == width
    return _Kernel(multiply, width)


def _build(width: int, isa: list[str]) -> Path:
    """The kernel's shared library for this width and these flags, compiled now unless the cache has it. Several
    workers may build at once: each compiles to a private file and renames it into place."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise OSError(f"no C compiler ({os.environ.get('CC', 'cc')!r} is not on PATH; set CC)")
    flags = ["-O3", "-ffp-contract=fast", "-fopenmp", "-fPIC", "-shared", f"-DVW={width}", *isa]
    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"row_gemm-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as staging:
        built = Path(staging) / target.name
        result = subprocess.run([compiler, *flags, str(_SOURCE), "-o", str(built)], capture_output=True, text=True,
                                timeout=120)
        if result.returncode != 0:
            raise OSError(f"{compiler} exited {result.returncode}: {result.stderr.strip()[-500:]}")
        os.replace(built, target)
    log.info("built the fp32 row kernel (%d-wide) into %s", width, target)
    return target
