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
    return (
        f"machine: {cpu}, {os.cpu_count()} cores, load average {load}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), device {name}, python {platform.python_version()}"
    )
