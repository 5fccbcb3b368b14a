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
    """The next cycle's items for the group of workers that holds `models` (its cycle is `cycle_id`)."""

    cycle_id: int
    models: tuple[str, ...]


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
    """Tell the clients of every waiting request on `models` why it waits (no worker can hold them): a Notice
    each."""

    message: str
    models: tuple[str, ...] | None = None  # None: every waiting request


@dataclass(frozen=True)
class Adapters:
    """The adapters every worker of a group's generation must hold: one per ready run of its `models`."""

    models: tuple[str, ...]


@dataclass(frozen=True)
class Place:
    """Place the base models anew on the live workers (`bios.coordinator.placement`): the new `Placement`."""


@dataclass(frozen=True)
class Layout:
    """How the group `group_id` holds its base models now (a `GroupLayout`; None once the group is gone)."""

    group_id: str


@dataclass(frozen=True)
class Formed:
    """Group `group_id` formed a generation of `workers`, in rank order."""

    group_id: str
    workers: tuple[str, ...]


@dataclass(frozen=True)
class GroupLayout:
    tp: int
    plans: tuple[m.ModelPlan, ...]
    workers: tuple[str, ...]  # the placement's workers of the group, holders first
    models: tuple[str, ...]


@dataclass(frozen=True)
class PlanDescriptions:
    """Base model -> its plan and estimate, for `bios status`."""


@dataclass(frozen=True)
class Committed:
    """Each adapter's checksum after the last commit: kept in the state dir, so a restarted coordinator knows
    which rejoining workers hold the current state."""

    models: tuple[str, ...]  # the base models of the group that committed: their adapters' entries are replaced
    checksums: dict[str, float]


@dataclass(frozen=True)
class Recovered:
    """Results of a cycle a worker committed but the log never recorded (the coordinator restarted)."""

    results: tuple[m.ItemDone, ...]


@dataclass(frozen=True)
class RunsLost:
    """These runs' state died with the worker pool and no checkpoint can bring it back."""

    model_ids: tuple[str, ...]
