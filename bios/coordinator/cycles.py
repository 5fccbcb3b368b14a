"""Runs one group's cycles (`bios.coordinator.groups`) on its current generation of workers, forming a new
generation whenever its members or its layout change.

Every member of the group is a replica: it holds every adapter of the group's base models and takes a
token-balanced shard of every batch, and their gradients are summed before each optimizer step. A new
generation (a join, a leave, a death, a failed collective) is formed between cycles
(`bios.coordinator.generations`).

A cycle hit by a failure is aborted: unfinished items go back to their queues and run again on the survivors.
Whether a member is alive is the heartbeats' call: a collective may wait up to `collective_timeout_s` for a busier
peer (one long row), and when the runner gives up on a cycle or a formation (a member was lost, or one aborted)
it tells the members still in it (`AbortGeneration`), whose collectives then end at once. A cycle that aborts
with every member alive (a collective timed out) is reported `stalled`: the scheduler runs its requests again in
a cycle of their own, and gives up on a request that stalls twice, so no pass can livelock the cluster.

Tensor parallelism (a base model's memory plan needs k > 1 workers): a generation is `world // k` replicas of
k shard holders (rank r holds shard r % k of replica r // k). Sample requests go to replicas (all k members of
one run the same items), with a seed drawn here when the request has none, so the k members draw the same
tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from dataclasses import dataclass, field

from bios import messages as m
from bios.actors.actor import ActorRef

from .clock import CycleClock
from .exchange import CycleOutcome, CyclePlan
from .generations import GenerationFormer, LoadState, Probe, SendToWorker
from .membership import Member, Membership
from .metrics import CoordinatorMetrics
from .roster import Roster
from .scheduler import Scheduler

log = logging.getLogger(__name__)

@dataclass
class _Cycle:
    cycle_id: int
    workers: set[str]
    expected: set[str]
    ops: dict[str, m.Request]
    waiting: set[str]
    results: dict[str, m.ItemDone] = field(default_factory=dict)  # request id -> its first result, in order
    checksums: dict[str, dict[str, float]] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    aborted: bool = False
    collective_failed: bool = False
    worker_died: bool = False  # a member was lost while running it (killed, out of memory, its host gone)
    reasons: list[str] = field(default_factory=list)  # why members aborted it, as they said
    given_up: bool = False  # its remaining members were told to abort it


class CycleRunner:
    def __init__(self, group_id: str, scheduler: ActorRef, clock: CycleClock, membership: Membership,
                 roster: Roster, generations: GenerationFormer, send: SendToWorker, load_state: LoadState,
                 probe: Probe, metrics: CoordinatorMetrics | None = None) -> None:
        self.group_id = group_id
        self.scheduler = scheduler
        self.clock = clock
        self.membership = membership
        self.roster = roster
        self.generations = generations
        self.send = send
        self.load_state = load_state
        self.probe = probe
        self.metrics = metrics or CoordinatorMetrics()
        self.current: _Cycle | None = None
        self.gone = False  # the placement dissolved the group: the runner ends
        self._leaving: list[Member] = []
        self._lock = asyncio.Lock()  # one cycle or one formation at a time
        self.phase_seconds: dict[str, float] = {}

    async def run_forever(self) -> None:
        watcher = asyncio.ensure_future(self._form_on_change())
        try:
            while not self.gone:
                await self.clock.next_tick()
                async with self._lock:
                    await self._tick(take_work=True)
        finally:
            watcher.cancel()
            self.roster.release(self.group_id)

    async def _tick(self, take_work: bool) -> None:
        """One exchange with the scheduler: its plan, then (when the generation is formed for the plan's layout)
        the cycle, whose outcome goes back in one `update`. A generation that must be formed first is formed,
        and the plan asked for again: work is taken only for a formed generation, so a lost run's work is never
        selected."""
        while True:
            settled = self.generations.settled_layout() if take_work else None
            plan: CyclePlan = await self.scheduler.ask(Scheduler.schedule, self.group_id, settled)
            if plan.layout is None:
                self.gone = True
                return
            if plan.items:
                await self._run_cycle(plan, self.generations.ranked)
                return
            if plan.wait_s:
                await self.clock.replies(plan.wait_s)
                continue
            if plan.layout.same_shape(settled):
                return  # formed, and no work
            await self.generations.settle(plan.layout, plan.adapters)
            if not take_work:
                return

    async def _form_on_change(self) -> None:
        """Form a new generation as soon as the group's members or layout change, not only when work arrives: a
        newcomer should hold the state before anyone else can die."""
        while not self.gone:
            seen = self.roster.version
            async with self._lock:
                await self._tick(take_work=False)
            if self.gone:
                self.clock.work_queued()  # wake the cycle loop, which ends
                return
            await self.roster.changed_since(seen)

    # ------------------------------------------------------------------------------------ cycles

    async def _run_cycle(self, plan: CyclePlan, members: list[Member]) -> None:
        items = plan.items
        training = [i for i in items if not isinstance(i.op, m.Sample)]
        dealt: dict[str, list[m.WorkItem]] = {mb.worker_id: [] for mb in members}
        tp = self.generations.layout.tp
        replicas = len(members) // tp
        for n, item in enumerate(i for i in items if isinstance(i.op, m.Sample)):
            if tp > 1 and item.op.sampling_params.seed is None:
                params = dataclasses.replace(item.op.sampling_params, seed=secrets.randbits(31))
                item = m.WorkItem(item.request_id, dataclasses.replace(item.op, sampling_params=params))
            replica = n % replicas
            for member in members[replica * tp : (replica + 1) * tp]:
                dealt[member.worker_id].append(item)
        cycle = _Cycle(
            cycle_id=plan.cycle_id,
            workers={mb.worker_id for mb in members},
            expected={item.request_id for item in items if item.last_part},  # a part more cycles continue: silent
            ops={item.request_id: item.op for item in items},
            waiting={mb.worker_id for mb in members},
        )
        cut = any(item.part is not None for item in items)
        self.current = cycle
        self.roster.occupy(self.group_id, list(cycle.workers))
        started = time.monotonic()
        for member in members:
            work = training + self._with_sampler_weights(member, dealt[member.worker_id])
            await self.send(member.peer, m.RunCycle(cycle.cycle_id, self.generations.generation, work))
        await cycle.done.wait()
        self.current = None
        self.roster.release(self.group_id)
        await self._release_leavers()
        duration = time.monotonic() - started
        self.clock.cycle_ran(duration)
        self.metrics.cycle_ran(duration, aborted=cycle.aborted)
        self._check_replicas(cycle)
        committed = self.generations.after_cycle(cycle.aborted, cycle.ops, cycle.checksums)
        stalled = cycle.aborted and cycle.collective_failed and not cycle.worker_died
        why = "; ".join(dict.fromkeys(cycle.reasons)) or "a member was lost"
        self.scheduler.tell(Scheduler.update, CycleOutcome(
            cycle.cycle_id, self.generations.layout.models, tuple(cycle.results.values()), cycle.aborted,
            cycle.worker_died, stalled, why, committed, self.clock.held_for(duration)))
        if cycle.aborted:
            log.warning("cycle %d aborted: %d of %d items will run again (%s%s)", cycle.cycle_id,
                        len(cycle.expected - cycle.results.keys()), len(cycle.expected),
                        "every member alive: " if stalled else "", why)
            if cycle.collective_failed:
                self.generations.rebuild("a collective failed; the group is rebuilt")
            elif cut:  # the parts' gradients still pending on the members go: the request starts again
                self.generations.rebuild("a cycle with part of a request cut over cycles aborted")
            self.clock.work_queued()

    def leaving(self, member: Member) -> None:
        """A graceful leave: the member finishes the cycle it is in, then is told to exit."""
        self._leaving.append(member)
        if self.current is None or member.worker_id not in self.current.workers:
            asyncio.ensure_future(self._release_leavers())

    async def _release_leavers(self) -> None:
        leaving, self._leaving = self._leaving, []
        for member in leaving:
            await self.send(member.peer, m.Shutdown("left the cluster"))
            self.membership.mark_dead(member.worker_id, "left")

    def _with_sampler_weights(self, worker: Member, items: list[m.WorkItem]) -> list[m.WorkItem]:
        """Attach a sampler checkpoint's tensors to the first sample that needs them on this worker."""
        out = []
        for item in items:
            op = item.op
            if op.adapter_path is not None and op.adapter_path not in worker.sampler_paths:
                try:
                    state = self.load_state(op.adapter_path)
                except Exception as exc:
                    log.warning("sampler weights %s could not be loaded: %s", op.adapter_path, exc)
                else:
                    item = m.WorkItem(item.request_id, dataclasses.replace(op, adapter_state=state))
                    worker.sampler_paths.add(op.adapter_path)
            out.append(item)
        return out

    def _check_replicas(self, cycle: _Cycle) -> None:
        """Replicas must agree bit for bit; if not, say so loudly and re-broadcast rank 0's state."""
        reports = list(cycle.checksums.values())
        for model_id in set().union(*reports) if reports else ():
            values = {r[model_id] for r in reports if model_id in r}
            if len(values) > 1:
                log.error("replicas of %s diverged after cycle %d (checksums %s); re-broadcasting from rank 0",
                          model_id, cycle.cycle_id, sorted(values))
                self.generations.rebuild(f"repair diverged replicas of {model_id}")

    def item_done(self, worker_id: str, done: m.ItemDone) -> None:
        cycle = self.current
        if cycle is None or done.cycle_id != cycle.cycle_id or worker_id not in cycle.workers:
            log.debug("dropped a late result for %s", done.request_id)
            return
        if done.request_id in cycle.ops and done.request_id not in cycle.results:  # (a part's only if it failed)
            cycle.results[done.request_id] = done
            op = cycle.ops.get(done.request_id)
            if isinstance(op, m.SaveWeights) and op.kind == "sampler_weights" and done.error is None:
                for member in self.generations.ranked:
                    member.sampler_paths.add(op.path)

    def sample_progress(self, worker_id: str, progress: m.SampleProgress) -> None:
        """A streaming sample's tokens so far: to its waiters, while it still runs in this cycle."""
        cycle = self.current
        if (cycle is not None and progress.cycle_id == cycle.cycle_id and worker_id in cycle.workers
                and progress.request_id in cycle.expected and progress.request_id not in cycle.results):
            self.scheduler.tell(Scheduler.sample_progress, progress)

    def worker_done(self, worker_id: str, done: m.CycleDone) -> None:
        cycle = self.current
        if cycle is None or cycle.cycle_id != done.cycle_id or worker_id not in cycle.waiting:
            return
        cycle.waiting.discard(worker_id)
        cycle.checksums[worker_id] = done.checksums
        ranked = self.generations.ranked
        if ranked and worker_id == ranked[0].worker_id:
            for phase, seconds in done.seconds.items():
                self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + seconds
        if done.aborted:
            cycle.aborted = cycle.collective_failed = True
            cycle.reasons.append(f"{worker_id}: {done.reason}")
            self.generations.abort_members(cycle, self.generations.generation,
                                           f"{worker_id} aborted cycle {cycle.cycle_id}")
            asyncio.ensure_future(self._probe_others(cycle))
        self._maybe_done(cycle)

    def worker_lost(self, member: Member) -> None:
        cycle = self.current
        if cycle is not None and member.worker_id in cycle.waiting:
            cycle.waiting.discard(member.worker_id)
            cycle.aborted = cycle.worker_died = True
            self.generations.abort_members(cycle, self.generations.generation, f"{member.worker_id} was lost")
            self._maybe_done(cycle)
        self.generations.worker_lost(member)

    def reconfigured(self, worker_id: str, done: m.Reconfigured) -> None:
        self.generations.reconfigured(worker_id, done)

    def _maybe_done(self, cycle: _Cycle) -> None:
        if not cycle.waiting:
            cycle.aborted = cycle.aborted or not cycle.expected <= cycle.results.keys()
            cycle.done.set()

    async def _probe_others(self, cycle: _Cycle) -> None:
        """A failed collective means a peer is likely dead: find out now rather than at the heartbeat timeout."""
        for worker_id in list(cycle.waiting):
            member = self.membership.members.get(worker_id)
            if member is not None and not await self.probe(member):
                self.membership.mark_dead(worker_id, "did not answer after a failed collective")
                self.worker_lost(member)
