"""The pid/state file of a `bios up` cluster: which process runs it and where it listens, for `bios down`.

`bios up` writes `<state-dir>/bios-up.json` once its cluster serves and removes it when it stops; a file whose
process is gone (a killed `bios up`) counts as absent. The process is matched by pid and start time, so a pid
reused by another program is never taken for the cluster.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

RECORD_NAME = "bios-up.json"


@dataclass(frozen=True)
class UpRecord:
    pid: int  # the `bios up` process: SIGTERM stops the cluster gracefully
    started: float  # its start time (psutil), to tell it from a later process with the same pid
    address: str  # clients: the native SDK, `bios status`
    http: str | None = None  # the Tinker gateway
    metrics: str | None = None  # Prometheus
    logs: dict[str, str] = field(default_factory=dict)  # "coordinator", "worker-0", ... -> log file

    def alive(self) -> bool:
        try:
            return psutil.Process(self.pid).create_time() == self.started
        except psutil.Error:
            return False


def record_path(state_dir: Path) -> Path:
    return Path(state_dir) / RECORD_NAME


def write_record(state_dir: Path, **fields: object) -> UpRecord:
    """Record this process as the one running the cluster of `state_dir`."""
    record = UpRecord(pid=os.getpid(), started=psutil.Process().create_time(), **fields)  # type: ignore[arg-type]
    path = record_path(state_dir)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(record), indent=2))
    tmp.replace(path)
    return record


def read_record(state_dir: Path) -> UpRecord | None:
    """The live cluster of `state_dir`, or None (no file, an unreadable one, or its process is gone)."""
    try:
        record = UpRecord(**json.loads(record_path(state_dir).read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return record if record.alive() else None


def remove_record(state_dir: Path) -> None:
    """Forget the cluster, if this process is the one recorded."""
    path = record_path(state_dir)
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass
