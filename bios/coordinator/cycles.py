"""Runs cycles: at each tick, take the scheduler's selected work to the workers and wait until it is done.

A cycle belongs to one generation of workers. If a member dies while the cycle runs, the cycle is aborted:
its unfinished items go back to their queues (in order) and run again in the next cycle.
"""

from __future__ import annotations

import asyncio
import dataclasses
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
LoadState = Callable[[str], m.CheckpointState]


@dataclass
class _Cycle:
    cycle_id: int
    generation: int
    workers: set[str]
    expected: set[str]
    ops: dict[str, Any]
    finished: set[str] = field(default_factory=set)
    waiting: set[str] = field(default_factory=set)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    aborted: bool = False


class CycleRunner:
    def __init__(self, scheduler: ActorRef, clock: CycleClock, membership: Membership, send: SendToWorker,
                 load_state: LoadState) -> None:
        self.scheduler = scheduler
        self.load_state = load_state
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
            ops={item.request_id: item.op for item in items},
            waiting={worker.worker_id},
        )
        self.current = cycle
        started = time.monotonic()
        await self.send(worker.peer, m.RunCycle(cycle.cycle_id, self._with_sampler_weights(worker, items)))
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

    def _with_sampler_weights(self, worker: Member, items: list[m.WorkItem]) -> list[m.WorkItem]:
        """Attach a sampler checkpoint's tensors to the first sample that needs them on this worker."""
        held = set(worker.sampler_paths)
        held.update(i.op.path for i in items if isinstance(i.op, m.SaveWeights) and i.op.kind == "sampler_weights")
        out = []
        for item in items:
            op = item.op
            if isinstance(op, m.Sample) and op.adapter_path is not None and op.adapter_path not in held:
                try:
                    state = self.load_state(op.adapter_path)
                except Exception as exc:
                    log.warning("sampler weights %s could not be loaded: %s", op.adapter_path, exc)
                else:
                    item = m.WorkItem(item.request_id, dataclasses.replace(op, adapter_state=state))
                    held.add(op.adapter_path)
                    worker.sampler_paths.add(op.adapter_path)
            out.append(item)
        return out

    def item_done(self, worker_id: str, done: m.ItemDone) -> None:
        cycle = self.current
        if cycle is None or done.cycle_id != cycle.cycle_id or worker_id not in cycle.workers:
            log.debug("dropped a late result for %s", done.request_id)
            return
        if done.request_id in cycle.expected and done.request_id not in cycle.finished:
            cycle.finished.add(done.request_id)
            op = cycle.ops.get(done.request_id)
            member = self.membership.members.get(worker_id)
            if isinstance(op, m.SaveWeights) and op.kind == "sampler_weights" and done.error is None and member:
                member.sampler_paths.add(op.path)
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
