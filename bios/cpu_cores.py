"""How many CPU cores this process may use: what a worker sizes its intra-op thread pool to.

torch's default is the machine's core count. In a container whose CPU quota is smaller (Kubernetes limits,
`docker --cpus`), or with several workers on one machine, that oversubscribes the cores: threads wait at
OpenMP barriers for a core instead of computing, and a step can take several times as long.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def usable_cores(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """The CPUs of this process's affinity mask, capped by its cgroup v2 CPU quota (rounded up); at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = _cgroup_quota(cpu_max)
    return max(1, min(cores, math.ceil(quota)) if quota else cores)


def threads_per_worker(workers: int, cores: int | None = None) -> int:
    """Intra-op threads for each of `workers` worker processes sharing this machine's usable cores."""
    return max(1, (usable_cores() if cores is None else cores) // max(1, workers))


def _cgroup_quota(cpu_max: Path) -> float | None:
    """CPUs' worth of time per period the cgroup allows ("200000 100000" -> 2.0), None without a limit."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None
