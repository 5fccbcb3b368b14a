"""One line naming the machine a benchmark ran on: CPU (and its native bf16 feature), load, torch, device.

Shared by bench/kernels.py and bench/training_step.py; their ratios only mean something next to this line.
"""

import os
import platform
from pathlib import Path

import torch

from bios.worker.compute_mode import native_bf16


def describe_machine() -> str:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cpu = platform.processor() or "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    feature = native_bf16(device)
    cpu += f" ({feature})" if feature else ""
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    limits = ", ".join(f"{key}={os.environ[key]}" for key in _ISA_LIMITS if key in os.environ)
    return (
        f"machine: {cpu}, {os.cpu_count()} cores, load average {load}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), device {name}, python {platform.python_version()}"
        + (f"; instruction sets limited by {limits}" if limits else "")
    )


# Environment variables that make this CPU's math libraries use fewer instructions, e.g. to measure what an
# AVX2-only CPU would do: MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
_ISA_LIMITS = ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
