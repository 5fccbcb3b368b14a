"""What a group's cycle runner and the scheduler exchange at each tick, as in vLLM's `EngineCore.step`: the
runner asks `Scheduler.schedule` for a `CyclePlan` (the group's layout, its adapters and the cycle's items) and
hands every result back in one `CycleOutcome` (`Scheduler.update`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from bios import messages as m


@dataclass(frozen=True)
class GroupLayout:
    """How a group holds its base models: tensor-parallel size, the models' plans, its workers and models."""

    tp: int
    plans: tuple[m.ModelPlan, ...]
    workers: tuple[str, ...]  # the placement's workers of the group, holders first
    models: tuple[str, ...]

    def same_shape(self, other: GroupLayout | None) -> bool:
        """Whether a generation formed for `other` can run this layout's work (the workers are the runner's
        business: it forms anew when its members change)."""
        return other is not None and dataclasses.replace(self, workers=()) == dataclasses.replace(other, workers=())


@dataclass(frozen=True)
class CyclePlan:
    """The scheduler's answer to a tick: the group's layout (None once the group is dissolved), the adapters a
    generation of it must hold, and the items of cycle `cycle_id` (none when there is no work, or when the
    generation must be formed for this layout first)."""

    layout: GroupLayout | None
    adapters: tuple[m.AdapterSpec, ...] = ()
    cycle_id: int = 0
    items: tuple[m.WorkItem, ...] = ()
    # No items yet: wait up to this long for the next calls of clients the last cycle answered, then ask again
    # (the next part of a request cut over cycles would otherwise start before the small runs are back)
    wait_s: float = 0.0


@dataclass(frozen=True)
class CycleOutcome:
    """How a cycle ended: every item result (in the order reported), and whether it was aborted and why."""

    cycle_id: int
    models: tuple[str, ...]  # the group's base models
    results: tuple[m.ItemDone, ...]
    aborted: bool
    worker_died: bool = False  # aborted because a member died while running it
    stalled: bool = False  # aborted with every member alive: a collective timed out (or a member's part failed)
    why: str = ""  # what the members said when they aborted it
    committed: dict[str, float] = field(default_factory=dict)  # the group's adapters' checksums after it
    seconds: float = 0.0  # how long it held the group (on a grid clock, until the next tick: `held_for`)

    @property
    def finished(self) -> frozenset[str]:
        return frozenset(done.request_id for done in self.results)
