"""The cluster's groups of workers: one cycle runner per group of the placement (`bios.coordinator.placement`),
started and ended as the placement changes, and the one door through which the workers' reports reach them.

The placement is the scheduler's (it owns the plans and the queues); this asks for it again whenever the
workers change or work arrives (a new run may have made a group), starts a runner for each new group, and lets
a dissolved group's runner finish its cycle and end. Each runner has its own clock, so a group's cycles never
wait for another's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable

from bios import messages as m
from bios.actors.actor import ActorRef

from .clock import CycleClock
from .cycles import CycleRunner
from .generations import SendToWorker
from .membership import Member, Membership
from .placement import Placement
from .roster import Roster
from .scheduler import Scheduler

log = logging.getLogger(__name__)

# Builds a group's runner: (group id, its clock, the shared roster, the coordinator's epoch) -> runner.
MakeRunner = Callable[[str, CycleClock, Roster, str], CycleRunner]


class Groups:
    def __init__(self, scheduler: ActorRef, membership: Membership, make_runner: MakeRunner, cycle_s: float,
                 send: SendToWorker) -> None:
        self.scheduler = scheduler
        self.membership = membership
        self.make_runner = make_runner
        self.cycle_s = cycle_s
        self.send = send
        self.roster = Roster()
        self.epoch = f"{uuid.uuid4().hex[:8]}/"  # generations restart with each coordinator incarnation
        self.placement = Placement()
        self.runners: dict[str, CycleRunner] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._clocks: list[CycleClock] = []
        self._poked = asyncio.Event()
        self._told: set[tuple[str, str]] = set()  # unplaced models whose waiting clients were told why

    # ------------------------------------------------------------------------------------ placement

    async def run_forever(self) -> None:
        try:
            while True:
                seen = self.membership.generation
                self._poked.clear()
                self._reconcile(await self.scheduler.ask(Scheduler.place))
                waits = [asyncio.ensure_future(self.membership.changed_since(seen)),
                         asyncio.ensure_future(self._poked.wait()), *self._tasks.values()]
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for future in waits[:2]:
                    future.cancel()
                for task in [t for t in done if t in self._tasks.values()]:
                    task.result()  # a runner that failed is a bug: raise it
                if self.membership.generation != seen:
                    self.roster.changed("the workers changed")
        finally:
            for task in self._tasks.values():
                task.cancel()
            for task in self._tasks.values():
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    def _reconcile(self, placement: Placement) -> None:
        """Start a runner for each new group; a dissolved group's runner sees it is gone and ends by itself."""
        changed = placement.layout() != self.placement.layout()
        self.placement = placement
        for group_id, task in list(self._tasks.items()):
            if task.done() and placement.group(group_id) is None:
                del self._tasks[group_id]
                del self.runners[group_id]
        for group in placement.groups:
            if group.group_id in self.runners and not self._tasks[group.group_id].done():
                continue
            clock = CycleClock(self.cycle_s)
            self._clocks.append(clock)
            runner = self.make_runner(group.group_id, clock, self.roster, self.epoch)
            self.runners[group.group_id] = runner
            self._tasks[group.group_id] = asyncio.ensure_future(runner.run_forever())
            clock.work_queued()  # its runs' first requests may already wait
            log.info("group %s: %s on %s", group.group_id, ", ".join(group.models), ", ".join(group.workers) or
                     "no worker yet")
        if changed:
            self.roster.changed("the placement changed")
        for model, why in placement.unplaced:
            if (model, why) not in self._told:
                log.warning("no live worker can hold %s: %s", model, why)
                self.scheduler.tell(Scheduler.notify_waiting,
                                    f"it waits for a worker with room for its base model ({why})", (model,))
        self._told = set(placement.unplaced)

    def work_queued(self) -> None:
        """Work arrived: every group looks for its share, and the placement is looked at again (a new run may
        have placed a new base model)."""
        for runner in self.runners.values():
            runner.clock.work_queued()
        self._poked.set()

    # ------------------------------------------------------------------------------------ workers' reports

    def item_done(self, worker_id: str, done: m.ItemDone) -> None:
        for runner in self.runners.values():
            runner.item_done(worker_id, done)

    def sample_progress(self, worker_id: str, progress: m.SampleProgress) -> None:
        for runner in self.runners.values():
            runner.sample_progress(worker_id, progress)

    def worker_done(self, worker_id: str, done: m.CycleDone) -> None:
        for runner in self.runners.values():
            runner.worker_done(worker_id, done)

    def reconfigured(self, worker_id: str, done: m.Reconfigured) -> None:
        for runner in self.runners.values():
            runner.reconfigured(worker_id, done)

    def worker_lost(self, member: Member) -> None:
        for runner in self.runners.values():
            runner.worker_lost(member)

    def leaving(self, member: Member) -> None:
        """A graceful leave: the group running a cycle with it (else the group it is placed in) lets it finish
        that cycle; a worker in no group goes at once."""
        group = self.placement.group_of_worker(member.worker_id)
        running = (r for r in self.runners.values() if r.current is not None and member.worker_id in r.current.workers)
        runner = next(running, self.runners.get(group.group_id) if group is not None else None)
        if runner is not None:
            runner.leaving(member)
            return
        asyncio.ensure_future(self.send(member.peer, m.Shutdown("left the cluster")))
        self.membership.mark_dead(member.worker_id, "left")

    # ------------------------------------------------------------------------------------ status

    @property
    def holders(self) -> set[str]:
        """The workers in their group's current generation."""
        placed = self.placed
        return {mb.worker_id for runner in self.runners.values() for mb in runner.generations.ranked
                if mb.worker_id in placed}

    @property
    def placed(self) -> dict[str, tuple[str, ...]]:
        """Each worker the placement puts in a group -> the base models it holds there."""
        return {worker: group.models for group in self.placement.groups for worker in group.workers}

    @property
    def parked(self) -> dict[str, str]:
        return dict(self.placement.parked)

    @property
    def phase_seconds(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for runner in self.runners.values():
            for phase, seconds in runner.phase_seconds.items():
                total[phase] = total.get(phase, 0.0) + seconds
        return total

    @property
    def cycles_run(self) -> int:
        return sum(clock.cycles_run for clock in self._clocks)

    @property
    def busy_s(self) -> float:
        return sum(clock.busy_s for clock in self._clocks)

    def group_status(self) -> list[m.GroupStatus]:
        """Each group as run: its base models, its workers (those in its generation), tensor-parallel size."""
        out = []
        for group in self.placement.groups:
            runner = self.runners.get(group.group_id)
            formed = [mb.worker_id for mb in runner.generations.ranked] if runner is not None else []
            out.append(m.GroupStatus(group.group_id, list(group.models), list(group.workers), group.tp,
                                     len(formed) // group.tp, formed))
        return out
