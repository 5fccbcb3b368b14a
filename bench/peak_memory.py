"""Peak memory of a piece of work above the level when it started, on CPU (RSS) or CUDA (allocator).

Shared by bench/kernels.py and bench/training_step.py. On CPU the RSS high-water mark is reset through
`/proc/self/clear_refs` (Linux), so one process measures one configuration from its current level.
"""

from pathlib import Path

import torch

MIB = 1 << 20


class PeakMemory:
    """Peak memory above the current level, for the device the benchmark runs on."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            self.base = _proc_status_kib("VmRSS") * 1024

    def extra_mib(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return (torch.cuda.max_memory_allocated() - self.base) / MIB
        return (_proc_status_kib("VmHWM") * 1024 - self.base) / MIB


def _proc_status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{key} missing from /proc/self/status: peak RSS needs Linux")
