"""How a coordinator is set up (`bios-coordinator`'s options) and where it listens once started."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bios import cluster_defaults
from bios.security.limits import Quotas

# After a restart, the first generation waits up to this many heartbeat timeouts for a worker that kept the
# runs' state to register again (workers notice the restart at their next heartbeat).
REJOIN_GRACE_HEARTBEATS = 2


@dataclass(frozen=True)
class CoordinatorConfig:
    listen: str = "tcp://127.0.0.1:7600"
    worker_port: int | None = None  # None: the client port + 1, or a free port when the client port is 0
    state_dir: Path = Path("bios-state")
    cycle_s: float = 10.0
    heartbeat_timeout_s: float = 5.0
    # How long a worker's collective may wait for a peer that is alive but busier (liveness is the heartbeats').
    collective_timeout_s: float = cluster_defaults.COLLECTIVE_TIMEOUT_S
    session_timeout_s: float = 600.0  # longer than the SDK's reconnect patience, so a returning client resumes
    stalled_after_s: float = 300.0  # the watchdog reports requests queued longer than this
    seq_gap_s: float = 120.0  # requests waiting this long behind a seq_id that never came are withdrawn
    worker_heartbeat_s: float = 1.0
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    quotas: Quotas = Quotas()


@dataclass(frozen=True)
class Addresses:
    clients: str
    workers: str
