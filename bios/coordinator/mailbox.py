"""The scheduler's mailbox: what the front door, the cycle runner and the server ask of it or tell it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bios import messages as m

from .admission import Submit

__all__ = ["Submit"]


@dataclass(frozen=True)
class Query:
    """A query about what the scheduler holds in memory: GetInfo, sampling sessions."""

    owner: str
    body: Any


QUERY_TYPES = (m.GetInfo, m.CreateSamplingSession, m.GetSamplingSession)


@dataclass(frozen=True)
class Watch:
    """`peer` wants the result of a request it sent before this coordinator started (the HTTP gateway after a
    restart): pushed now if it is logged, else when it comes."""

    peer: bytes
    owner: str
    request_id: str


@dataclass(frozen=True)
class Stalled:
    """Why requests queued longer than `older_than_s` have not run: one line per run (the watchdog logs them)."""

    older_than_s: float


@dataclass(frozen=True)
class ExpireGaps:
    """Withdraw the requests that have waited `gap_s` behind a seq_id that never came."""

    gap_s: float


@dataclass(frozen=True)
class SelectWork:
    pass


@dataclass(frozen=True)
class Finished:
    done: m.ItemDone


@dataclass(frozen=True)
class CycleEnded:
    cycle_id: int
    finished: frozenset[str]
    aborted: bool
    worker_died: bool = False  # aborted because a member died while running it
    stalled: bool = False  # aborted with every member alive: a collective timed out (or a member's part failed)
    why: str = ""  # what the members said when they aborted it


@dataclass(frozen=True)
class QueueDepth:
    by_pool: bool = False  # a dict base model -> depth instead of the total


@dataclass(frozen=True)
class NotifyWaiting:
    """Tell the clients of every waiting request why it waits (no worker is connected): a Notice each."""

    message: str


@dataclass(frozen=True)
class Adapters:
    """The adapters every worker of a generation must hold: one per ready run."""


@dataclass(frozen=True)
class Layout:
    """How the pool holds its base models: the tensor-parallel size, each base model's plan, and the live
    workers whose budget cannot hold them (parked)."""


@dataclass(frozen=True)
class PoolLayout:
    tp: int
    plans: tuple[m.ModelPlan, ...]
    parked: tuple[tuple[str, str], ...] = ()  # (worker id, why it waits): live workers left out of the generation


@dataclass(frozen=True)
class PlanDescriptions:
    """Base model -> its plan and estimate, for `bios status`."""


@dataclass(frozen=True)
class Committed:
    """Each adapter's checksum after the last commit: kept in the state dir, so a restarted coordinator knows
    which rejoining workers hold the current state."""

    checksums: dict[str, float]


@dataclass(frozen=True)
class Recovered:
    """Results of a cycle a worker committed but the log never recorded (the coordinator restarted)."""

    results: tuple[m.ItemDone, ...]


@dataclass(frozen=True)
class RunsLost:
    """These runs' state died with the worker pool and no checkpoint can bring it back."""

    model_ids: tuple[str, ...]
