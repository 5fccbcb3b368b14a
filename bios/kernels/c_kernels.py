"""Bios's C kernels (`csrc/*.c`): built on first use with the machine's C compiler, loaded with ctypes.

A decode step's few rows leave PyTorch's and MKL's kernels short of the machine: its weight products stream
weights at about half of what the cores read (`row_gemm`), its attention is a dozen small ops a layer
(`decode_attention`), and its norms, RoPE and SwiGLU are more small ops, each run with cold caches
(`decode_ops`). A training pass's fp32 SwiGLU and RMSNorm, forward and backward, are several passes over
activation-sized tensors each in PyTorch's ops and one here (`csrc/training_ops.c`, called by `norms`). The C
here is small, plain and vectorized with GCC's vector extensions (which clang shares) for the CPU's width, so one
source serves AVX-512 and AVX2. It is compiled with `$CC` (else `cc`; -O3, OpenMP with GCC, AVX-512 or
AVX2+FMA as `c_isa` says: `BIOS_C_ISA`, else PyTorch's CPU capability, so `ATEN_CPU_CAPABILITY=avx2` or
`BIOS_C_ISA=avx2` builds the AVX2 kernels on an AVX-512 machine, as an AVX2-only CPU runs them) into
`<bios cache>/kernels/`, keyed by the sources and flags, once per machine. Without a compiler, on other CPUs, or
with `BIOS_C_KERNELS=off`, nothing changes: callers keep PyTorch's ops (the worker logs why once). The library's
OpenMP is PyTorch's: loaded after torch, its `libgomp.so.1` resolves to the copy torch loaded, so both share one
thread pool, sized per call to `torch.get_num_threads()` (clang builds run single-threaded: `_dialect_flags`).
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

_SOURCES = Path(__file__).with_name("csrc")
# PyTorch's CPU capability -> the vector width in floats, the compiler's instruction-set flags.
_ISA_FLAGS = {"AVX512": (16, ["-mavx512f", "-mavx512vl", "-mavx2", "-mfma"]), "AVX2": (8, ["-mavx2", "-mfma"])}
# The C functions' arguments, as csrc/*.c declare them (they return nothing).
_p, _i, _l, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
_SIGNATURES = {
    "bios_row_gemm": [_p, _l, _p, _p, _p, _l, _i, _i, _i, _i],
    "bios_cascade_attention": [_p, _l, _p, _p, _i, _p, _p, _l, _l, _l, _l, _i, _p, _i, _i, _i, _i, _i, _f, _i],
    "bios_add_rms_norm": [_p, _l, _p, _l, _p, _p, _l, _p, _i, _i, _f, _i],
    "bios_rotate": [_p, _l, _p, _l, _i, _i, _i, _p, _p, _i],
    "bios_swiglu": [_p, _l, _p, _i, _i, _i],
    "bios_swiglu_backward": [_p, _l, _p, _l, _p, _l, _i, _i, _i],
    "bios_rms_norm_backward": [_p, _p, _p, _p, _p, _p, _i, _i, _i],
    "bios_log_softmax_rows": [_p, _l, _i, _p, _p, _p, _p, _i, _i, _i, _i],
    "bios_rms_norm_bf16": [_p, _p, _p, _p, _i, _i, _f, _i],
    "bios_rms_norm_backward_bf16": [_p, _p, _p, _p, _p, _i, _i, _i],
    "bios_rotate_bf16": [_p, _l, _p, _l, _i, _i, _i, _p, _p, _i],
    "bios_interval_attention": [_p] * 10 + [_i] * 6 + [_f, _i],
    "bios_interval_attention_backward": [_p] * 14 + [_i] * 6 + [_f, _i],
}


class CKernels(NamedTuple):
    library: ctypes.CDLL
    width: int  # floats in one vector register of the instruction set it was built for


def c_isa() -> str | None:
    """The instruction set Bios's CPU code is built for and may count on: "AVX512" or "AVX2", as `BIOS_C_ISA`
    ("avx2" or "avx512") says, else PyTorch's CPU capability (which `ATEN_CPU_CAPABILITY` caps); None on a CPU
    with neither. `BIOS_C_ISA=avx2` runs an AVX-512 machine's C kernels, and the worker's choice of base dtype,
    as an AVX2-only CPU would (set ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 beside it for PyTorch's)."""
    capability = torch.backends.cpu.get_cpu_capability()
    asked = os.environ.get("BIOS_C_ISA", "").strip().upper()
    if asked in ("", "AUTO"):
        return capability if capability in _ISA_FLAGS else None
    if asked not in _ISA_FLAGS:
        raise ValueError(f"BIOS_C_ISA must be 'avx2' or 'avx512' (unset: PyTorch's CPU capability, {capability}), "
                         f"got {asked.lower()!r}")
    if asked == "AVX512" and capability != "AVX512":
        raise ValueError(f"BIOS_C_ISA=avx512, but PyTorch's CPU capability is {capability}: this CPU (or "
                         "ATEN_CPU_CAPABILITY) has no AVX-512")
    return asked


def c_kernels_setting() -> str:
    """`BIOS_C_KERNELS` (unset: "auto"): whether decode steps and training passes may use the C kernels."""
    value = os.environ.get("BIOS_C_KERNELS", "").strip().lower() or "auto"
    if value not in ("auto", "off"):
        raise ValueError(f"BIOS_C_KERNELS must be 'auto' or 'off' (unset: auto), got {value!r}")
    return value


def c_library_for(*tensors: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,),
                  whole: bool = True) -> ctypes.CDLL | None:
    """The kernels' library where they may take these tensors, else None (the caller keeps PyTorch's ops): all on
    CPU and of one dtype among `dtypes`, laid out as the kernel reads them (`whole`: contiguous; else rows at any
    stride, the last dim contiguous), and the kernels built and allowed (`c_kernels`)."""
    first = tensors[0]
    if first.dtype not in dtypes or not all(
            t.dtype == first.dtype and t.device.type == "cpu" and (t.is_contiguous() if whole else t.stride(-1) == 1)
            for t in tensors):
        return None
    kernels = c_kernels()
    return None if kernels is None else kernels.library


def c_compiler() -> str | None:
    """The C compiler the kernels are built with: `$CC`, else `cc`, if it is on PATH."""
    return shutil.which(os.environ.get("CC", "cc"))


def c_kernels() -> CKernels | None:
    """The built kernels where the setting allows them and they build here, else None."""
    return None if c_kernels_setting() == "off" else _loaded()


@cache
def _loaded() -> CKernels | None:
    capability = c_isa()
    if platform.machine().lower() not in ("x86_64", "amd64") or capability is None:
        log.info("decode steps and training passes keep PyTorch's ops: Bios's C kernels need an x86 CPU with AVX2 "
                 "(this is %s, PyTorch's capability %s)", platform.machine(), torch.backends.cpu.get_cpu_capability())
        return None
    width, isa = _ISA_FLAGS[capability]
    try:
        path = _build(width, isa)
        library = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as error:
        log.warning("decode steps and training passes keep PyTorch's ops: could not build bios/kernels/csrc (%s)",
                    error)
        return None
    if library.bios_vector_width() != width:
        raise RuntimeError(f"bios/kernels/csrc built for {library.bios_vector_width()} floats, expected {width}")
    for name, arguments in _SIGNATURES.items():
        function = getattr(library, name)
        function.restype, function.argtypes = None, arguments
    log.info("decode steps and training passes use Bios's C kernels (%s, %d-float vectors): %s", capability, width,
             path)
    return CKernels(library, width)


@cache
def _dialect_flags(compiler: str) -> list[str]:
    """GCC: products and sums fused into FMAs across statements (`fast`; RoPE turns it off with GCC's `optimize`
    pragma to stay bit for bit PyTorch's) and OpenMP through libgomp, PyTorch's own thread pool. clang: FMAs within
    a statement (`on`, the setting under which it honours its own `fp contract` pragma) and OpenMP's `simd`
    loops only, since its runtime would be LLVM's libomp, a second thread pool beside PyTorch's (SmolLM2's SwiGLU
    2.4x slower with both on 2 cores): its kernels run on the calling thread."""
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    if "clang" in version.lower():
        return ["-ffp-contract=on", "-fopenmp-simd"]
    return ["-ffp-contract=fast", "-fopenmp"]


def _build(width: int, isa: list[str]) -> Path:
    """The shared library of every `csrc/*.c` for this width and these flags, compiled now unless the cache has
    it. Several workers may build at once: each compiles to a private file and renames it into place."""
    compiler = c_compiler()
    if compiler is None:
        raise OSError(f"no C compiler ({os.environ.get('CC', 'cc')!r} is not on PATH; set CC)")
    flags = ["-O3", *_dialect_flags(compiler), "-fPIC", "-shared", f"-DVW={width}", *isa]
    sources = sorted(_SOURCES.glob("*.c"))
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in sorted(_SOURCES.iterdir()))
                            + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"bios-kernels-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as staging:
        built = Path(staging) / target.name
        result = subprocess.run([compiler, *flags, *map(str, sources), "-o", str(built)], capture_output=True,
                                text=True, timeout=120)
        if result.returncode != 0:
            raise OSError(f"{compiler} exited {result.returncode}: {result.stderr.strip()[-500:]}")
        os.replace(built, target)
    log.info("built Bios's C kernels with %s", compiler)
    return target
