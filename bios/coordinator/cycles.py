"""Runs cycles: at each tick, take the scheduler's selected work to the workers and wait until it is done.

A cycle belongs to one generation of workers. If a member dies while the cycle runs, the cycle is aborted:
its unfinished items go back to their queues (in order) and run again in the next cycle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from bios import messages as m
from bios.actors.actor import ActorRef

from .clock import CycleClock
from .membership import Member, Membership
from .scheduler import CycleEnded, Finished, SelectWork

log = logging.getLogger(__name__)

SendToWorker = Callable[[bytes, Any], Awaitable[None]]


@dataclass
class _Cycle:
    cycle_id: int
    generation: int
    workers: set[str]
    expected: set[str]
    finished: set[str] = field(default_factory=set)
    waiting: set[str] = field(default_factory=set)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    aborted: bool = False


class CycleRunner:
    def __init__(self, scheduler: ActorRef, clock: CycleClock, membership: Membership, send: SendToWorker) -> None:
        self.scheduler = scheduler
        self.clock = clock
        self.membership = membership
        self.send = send
        self.current: _Cycle | None = None
        self._next_id = 0

    async def run_forever(self) -> None:
        while True:
            await self.clock.next_tick()
            items: list[m.WorkItem] = await self.scheduler.ask(SelectWork())
            if items:
                await self._run_cycle(items)

    async def _run_cycle(self, items: list[m.WorkItem]) -> None:
        members = await self.membership.wait_for_alive()
        self._next_id += 1
        worker = members[0]  # registration order: until data parallelism, the first member holds every adapter
        cycle = _Cycle(
            cycle_id=self._next_id,
            generation=self.membership.generation,
            workers={worker.worker_id},
            expected={item.request_id for item in items},
            waiting={worker.worker_id},
        )
        self.current = cycle
        started = time.monotonic()
        await self.send(worker.peer, m.RunCycle(cycle.cycle_id, items))
        await cycle.done.wait()
        self.current = None
        self.clock.cycle_ran(time.monotonic() - started)
        self.scheduler.tell(CycleEnded(cycle.cycle_id, frozenset(cycle.finished), cycle.aborted))
        if cycle.aborted:
            log.warning(
                "cycle %d aborted: %d of %d items will run again",
                cycle.cycle_id, len(cycle.expected - cycle.finished), len(cycle.expected),
            )
            self.clock.work_queued()

    def item_done(self, worker_id: str, done: m.ItemDone) -> None:
        cycle = self.current
        if cycle is None or done.cycle_id != cycle.cycle_id or worker_id not in cycle.workers:
            log.debug("dropped a late result for %s", done.request_id)
            return
        if done.request_id in cycle.expected and done.request_id not in cycle.finished:
            cycle.finished.add(done.request_id)
            self.scheduler.tell(Finished(done))

    def worker_done(self, worker_id: str, cycle_id: int) -> None:
        cycle = self.current
        if cycle is None or cycle.cycle_id != cycle_id:
            return
        cycle.waiting.discard(worker_id)
        if not cycle.waiting:
            cycle.aborted = cycle.finished != cycle.expected
            cycle.done.set()

    def worker_lost(self, member: Member) -> None:
        cycle = self.current
        if cycle is not None and member.worker_id in cycle.workers:
            cycle.aborted = True
            cycle.done.set()
