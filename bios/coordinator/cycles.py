"""Runs one group's cycles (`bios.coordinator.groups`) on its current generation of workers, forming a new
generation whenever its members or its layout change.

Every member of the group is a replica: it holds every adapter of the group's base models and takes a
token-balanced shard of every batch, and their gradients are summed before each optimizer step. A new
generation (a join, a leave, a death, a failed collective) is formed between cycles: ranks are assigned, rank 0
is a worker that already holds the current state, and every member takes each adapter's state from rank 0 by
broadcast. If no member holds state (the whole group was lost) runs restore from their latest automatic
checkpoint.

A cycle hit by a failure is aborted: unfinished items go back to their queues and run again on the survivors.
Whether a member is alive is the heartbeats' call: a collective may wait up to `collective_timeout_s` for a busier
peer (one long row), and when the runner gives up on a cycle or a formation (a member was lost, or one aborted)
it tells the members still in it (`AbortGeneration`), whose collectives then end at once. A cycle that aborts
with every member alive (a collective timed out) is reported `stalled`: the scheduler runs its requests again in
a cycle of their own, and gives up on a request that stalls twice, so no pass can livelock the cluster.

Which workers are the group's is the placement's call (`bios.coordinator.placement`); a worker the placement
moves here from another group joins once that group has finished the cycle or formation it runs with it. When
the group has too few workers for one replica nothing runs: its requests wait, with a notice, for a worker.

Tensor parallelism (a base model's memory plan needs k > 1 workers): a generation is `world // k` replicas of
k shard holders (rank r holds shard r % k of replica r // k); members beyond a multiple of k stand by. Rank j
of replica 0 is a survivor holding shard j, which every other replica's rank j takes by broadcast; when no
survivor holds some shard, every adapter restores from its latest automatic checkpoint. Sample requests go to
replicas (all k members of one run the same items), with a seed drawn here when the request has none, so the
k members draw the same tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from bios import messages as m
from bios.cluster_defaults import COLLECTIVE_TIMEOUT_S
from bios.actors.actor import ActorRef

from .adoption import adoptable
from .clock import CycleClock
from .membership import Member, Membership
from .ranking import rank_members
from .roster import Roster
from .metrics import CoordinatorMetrics
from .mailbox import (Adapters, Committed, CycleEnded, Finished, Formed, GroupLayout, Layout, NotifyWaiting, Recovered,
                      RunsLost, SelectWork)

log = logging.getLogger(__name__)

SendToWorker = Callable[[bytes, Any], Awaitable[None]]
LoadState = Callable[[str], m.CheckpointState]
LatestCheckpoint = Callable[[str], str | None]
Probe = Callable[[Member], Awaitable[bool]]

RECONFIGURE_TIMEOUT_S = 180.0  # newcomers may have to load base models first


@dataclass
class _Cycle:
    cycle_id: int
    workers: set[str]
    expected: set[str]
    ops: dict[str, Any]
    waiting: set[str]
    finished: set[str] = field(default_factory=set)
    checksums: dict[str, dict[str, float]] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    aborted: bool = False
    collective_failed: bool = False
    worker_died: bool = False  # a member was lost while running it (killed, out of memory, its host gone)
    reasons: list[str] = field(default_factory=list)  # why members aborted it, as they said
    given_up: bool = False  # its remaining members were told to abort it


@dataclass
class _Forming:
    generation: int
    waiting: set[str]
    failed: set[str] = field(default_factory=set)
    checksums: dict[str, dict[str, float]] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    given_up: bool = False  # its remaining members were told to abort it


class CycleRunner:
    def __init__(self, group_id: str, scheduler: ActorRef, clock: CycleClock, membership: Membership,
                 roster: Roster, send: SendToWorker, load_state: LoadState, latest_checkpoint: LatestCheckpoint,
                 probe: Probe, join_timeout_s: float, epoch: str, collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
                 metrics: CoordinatorMetrics | None = None, committed: dict[str, float] | None = None,
                 rejoin_grace_s: float = 0.0) -> None:
        self.group_id = group_id
        self.scheduler = scheduler
        self.clock = clock
        self.membership = membership
        self.roster = roster
        self.send = send
        self.load_state = load_state
        self.latest_checkpoint = latest_checkpoint
        self.probe = probe
        self.join_timeout_s = join_timeout_s  # how long members wait for each other to join a generation
        self.collective_timeout_s = collective_timeout_s
        self.metrics = metrics or CoordinatorMetrics()
        self.current: _Cycle | None = None
        self.forming: _Forming | None = None
        self.generation = -1
        self.epoch = epoch  # the rendezvous keys of this coordinator's generations are its own
        self.ranked: list[Member] = []
        self.holders: set[str] = set()
        # Each adapter's checksum after the last cycle or generation that changed it (whole adapters only): a
        # worker that rejoins holding exactly these can be the source when no holder survived. Kept in the state
        # dir, so a restarted coordinator waits up to `rejoin_grace_s` for such a worker before restoring.
        self.committed: dict[str, float] = dict(committed or {})
        self._rejoin_deadline = time.monotonic() + rejoin_grace_s if committed else 0.0
        self.shards: dict[str, tuple[int, int]] = {}  # worker id -> (tp, shard) it holds
        self.layout = GroupLayout(1, (), (), ())  # the layout the current generation runs
        self._formed: tuple[frozenset[int], GroupLayout] | None = None  # members (as objects) and layout formed
        self._stale = False  # the same members must form again (a collective failed, replicas diverged)
        self.gone = False  # the placement dissolved the group: the runner ends
        self._join_failures: dict[str, int] = {}
        self._leaving: list[Member] = []
        self._lock = asyncio.Lock()
        self.phase_seconds: dict[str, float] = {}

    async def run_forever(self) -> None:
        watcher = asyncio.ensure_future(self._form_on_change())
        try:
            while not self.gone:
                await self.clock.next_tick()
                async with self._lock:
                    members = await self._current_generation()  # form first: a lost run's work is never selected
                    if members is None:
                        break
                    cycle_id = self.roster.next_cycle_id()
                    items: list[m.WorkItem] = await self.scheduler.ask(SelectWork(cycle_id, self.layout.models))
                    if items:
                        await self._run_cycle(cycle_id, members, items)
        finally:
            watcher.cancel()
            self.roster.release(self.group_id)

    async def _form_on_change(self) -> None:
        """Form a new generation as soon as the group's members or layout change, not only when work arrives: a
        newcomer should hold the state before anyone else can die."""
        while True:
            seen = self.roster.version
            async with self._lock:
                if await self._current_generation() is None:
                    self.gone = True
                    self.clock.work_queued()  # wake the cycle loop, which ends
                    return
            await self.roster.changed_since(seen)

    # ------------------------------------------------------------------------------------ cycles

    async def _run_cycle(self, cycle_id: int, members: list[Member], items: list[m.WorkItem]) -> None:
        training = [i for i in items if not isinstance(i.op, m.Sample)]
        dealt: dict[str, list[m.WorkItem]] = {mb.worker_id: [] for mb in members}
        tp = self.layout.tp
        replicas = len(members) // tp
        for n, item in enumerate(i for i in items if isinstance(i.op, m.Sample)):
            if tp > 1 and item.op.sampling_params.seed is None:
                params = dataclasses.replace(item.op.sampling_params, seed=secrets.randbits(31))
                item = m.WorkItem(item.request_id, dataclasses.replace(item.op, sampling_params=params))
            replica = n % replicas
            for member in members[replica * tp : (replica + 1) * tp]:
                dealt[member.worker_id].append(item)
        cycle = _Cycle(
            cycle_id=cycle_id,
            workers={mb.worker_id for mb in members},
            expected={item.request_id for item in items},
            ops={item.request_id: item.op for item in items},
            waiting={mb.worker_id for mb in members},
        )
        self.current = cycle
        self.roster.occupy(self.group_id, list(cycle.workers))
        started = time.monotonic()
        for member in members:
            work = training + self._with_sampler_weights(member, dealt[member.worker_id])
            await self.send(member.peer, m.RunCycle(cycle.cycle_id, self.generation, work))
        await cycle.done.wait()
        self.current = None
        self.roster.release(self.group_id)
        await self._release_leavers()
        duration = time.monotonic() - started
        self.clock.cycle_ran(duration)
        self.metrics.cycle_ran(duration, aborted=cycle.aborted)
        self._check_replicas(cycle)
        if cycle.aborted:  # an aborted cycle may have changed some replicas: its adapters are unknown until re-formed
            for op in cycle.ops.values():
                self.committed.pop(getattr(op, "model_id", ""), None)
        elif self.ranked and self.layout.tp == 1:
            self.committed.update(cycle.checksums.get(self.ranked[0].worker_id, {}))
        self.scheduler.tell(Committed(self.layout.models, dict(self.committed)))
        stalled = cycle.aborted and cycle.collective_failed and not cycle.worker_died
        why = "; ".join(dict.fromkeys(cycle.reasons)) or "a member was lost"
        self.scheduler.tell(CycleEnded(cycle.cycle_id, frozenset(cycle.finished), cycle.aborted, cycle.worker_died,
                                       stalled=stalled, why=why))
        if cycle.aborted:
            log.warning("cycle %d aborted: %d of %d items will run again (%s%s)", cycle.cycle_id,
                        len(cycle.expected - cycle.finished), len(cycle.expected),
                        "every member alive: " if stalled else "", why)
            if cycle.collective_failed:
                self._rebuild("a collective failed; the group is rebuilt")
            self.clock.work_queued()

    def _rebuild(self, why: str) -> None:
        """Form the group's generation again with the same members."""
        self._stale = True
        self.roster.changed(f"{self.group_id}: {why}")

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
                self._rebuild(f"repair diverged replicas of {model_id}")

    def item_done(self, worker_id: str, done: m.ItemDone) -> None:
        cycle = self.current
        if cycle is None or done.cycle_id != cycle.cycle_id or worker_id not in cycle.workers:
            log.debug("dropped a late result for %s", done.request_id)
            return
        if done.request_id in cycle.expected and done.request_id not in cycle.finished:
            cycle.finished.add(done.request_id)
            op = cycle.ops.get(done.request_id)
            if isinstance(op, m.SaveWeights) and op.kind == "sampler_weights" and done.error is None:
                for member in self.ranked:
                    member.sampler_paths.add(op.path)
            self.scheduler.tell(Finished(done))

    def sample_progress(self, worker_id: str, progress: m.SampleProgress) -> None:
        """A streaming sample's tokens so far: to its waiters, while it still runs in this cycle."""
        cycle = self.current
        if (cycle is not None and progress.cycle_id == cycle.cycle_id and worker_id in cycle.workers
                and progress.request_id in cycle.expected and progress.request_id not in cycle.finished):
            self.scheduler.tell(progress)

    def worker_done(self, worker_id: str, done: m.CycleDone) -> None:
        cycle = self.current
        if cycle is None or cycle.cycle_id != done.cycle_id or worker_id not in cycle.waiting:
            return
        cycle.waiting.discard(worker_id)
        cycle.checksums[worker_id] = done.checksums
        if self.ranked and worker_id == self.ranked[0].worker_id:
            for phase, seconds in done.seconds.items():
                self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + seconds
        if done.aborted:
            cycle.aborted = cycle.collective_failed = True
            cycle.reasons.append(f"{worker_id}: {done.reason}")
            self._abort_members(cycle, self.generation, f"{worker_id} aborted cycle {cycle.cycle_id}")
            asyncio.ensure_future(self._probe_others(cycle))
        self._maybe_done(cycle)

    def worker_lost(self, member: Member) -> None:
        for state in (self.current, self.forming):
            if state is not None and member.worker_id in state.waiting:
                state.waiting.discard(member.worker_id)
                if isinstance(state, _Cycle):
                    state.aborted = state.worker_died = True
                    self._abort_members(state, self.generation, f"{member.worker_id} was lost")
                    self._maybe_done(state)
                else:
                    state.failed.add(member.worker_id)
                    self._abort_members(state, state.generation, f"{member.worker_id} was lost")
                    if not state.waiting:
                        state.done.set()

    def _abort_members(self, state: _Cycle | _Forming, generation: int, reason: str) -> None:
        """Tell the members still in a cycle or formation that it is given up (once): their collectives with
        the lost or failed member would otherwise wait out the collective timeout."""
        if state.given_up:
            return
        state.given_up = True
        for worker_id in state.waiting:
            member = self.membership.members.get(worker_id)
            if member is not None and member.state != "dead":
                asyncio.ensure_future(self.send(member.peer, m.AbortGeneration(self.epoch, generation, reason)))

    def _maybe_done(self, cycle: _Cycle) -> None:
        if not cycle.waiting:
            cycle.aborted = cycle.aborted or cycle.finished != cycle.expected
            cycle.done.set()

    async def _probe_others(self, cycle: _Cycle) -> None:
        """A failed collective means a peer is likely dead: find out now rather than at the heartbeat timeout."""
        for worker_id in list(cycle.waiting):
            member = self.membership.members.get(worker_id)
            if member is not None and not await self.probe(member):
                self.membership.mark_dead(worker_id, "did not answer after a failed collective")
                self.worker_lost(member)

    # ------------------------------------------------------------------------------------ generations

    async def _current_generation(self) -> list[Member] | None:
        """The group's generation, formed anew when its members (the placement's, once no other group still
        runs a cycle with them) or its layout changed, or when it must be rebuilt; None once it is dissolved."""
        while True:
            seen = self.roster.version
            layout: GroupLayout | None = await self.scheduler.ask(Layout(self.group_id))
            if layout is None:
                return None
            live = {mb.worker_id: mb for mb in self.membership.alive()}
            members = [live[w] for w in layout.workers if w in live and not self.roster.busy_elsewhere(w, self.group_id)]
            if self._rejoin_deadline and await self._wait_for_rejoin(members, layout, seen):
                continue
            formed = (frozenset(id(mb) for mb in members), dataclasses.replace(layout, workers=()))
            if formed == self._formed and not self._stale:
                return self.ranked
            if len(members) < max(1, layout.tp):
                await self._wait_for_room(len(members), layout, seen)
                continue
            if await self._form(members, layout):
                self._formed, self._stale = formed, False
                return self.ranked

    async def _wait_for_room(self, serving: int, layout: GroupLayout, seen: int) -> None:
        """Too few workers for one replica: say why, then wait for the roster to change."""
        models = ", ".join(layout.models)
        if serving or layout.workers:
            log.warning("%s: %d worker(s) can serve, but its plan splits it over %d: waiting for more", models,
                        serving, layout.tp)
        else:
            log.warning("no live worker can hold %s", models)
            await self.scheduler.ask(NotifyWaiting(f"it waits for a worker with room for its base model ({models})",
                                                   layout.models))
        await self.roster.changed_since(seen)

    async def _wait_for_rejoin(self, members: list[Member], layout: GroupLayout, seen: int) -> bool:
        """After a coordinator restart, wait (a little) for a worker that kept the group's state to register
        again, so a newcomer that registers first does not make its runs restore from disk; True after a wait."""
        left = self._rejoin_deadline - time.monotonic()
        self._keep_committed(await self.scheduler.ask(Adapters(layout.models)))
        if left <= 0 or not self.committed or any(adoptable(mb, self.committed) is not None for mb in members):
            self._rejoin_deadline = 0.0
            return False
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.roster.changed_since(seen), left)
        return True

    async def _form(self, members: list[Member], layout: GroupLayout) -> bool:
        generation = self.roster.next_generation()
        adapters: list[m.AdapterSpec] = await self.scheduler.ask(Adapters(layout.models))
        if adapters and layout.tp == self.layout.tp == 1 and not any(mb.worker_id in self.holders for mb in members):
            self._adopt_rejoined(members, adapters)
        ranked, source_tp = rank_members(members, layout.tp, self.holders, self.shards, self.layout.tp)
        restore: dict[str, m.CheckpointState] = {}
        if adapters and source_tp is None:
            adapters, restore = self._restore_from_checkpoints(adapters)
        master = ranked[0]
        forming = _Forming(generation, {mb.worker_id for mb in ranked})
        self.forming = forming
        self.roster.occupy(self.group_id, [mb.worker_id for mb in ranked])
        for rank, member in enumerate(ranked):
            if self.shards.get(member.worker_id) != (layout.tp, rank % layout.tp):
                member.sampler_paths.clear()  # a newcomer, or a holder of another shard: samplers are reloaded
            await self.send(member.peer, m.Reconfigure(generation, rank, len(ranked), master.store_host,
                                                       master.store_port, self.join_timeout_s, adapters,
                                                       restore, layout.tp, source_tp or layout.tp, list(layout.plans),
                                                       self.epoch, self.collective_timeout_s))
        try:
            await asyncio.wait_for(forming.done.wait(), RECONFIGURE_TIMEOUT_S)
        except asyncio.TimeoutError:
            forming.failed |= forming.waiting
            self._abort_members(forming, generation, f"not formed within {RECONFIGURE_TIMEOUT_S:.0f}s")
        self.forming = None
        self.roster.release(self.group_id)
        if forming.failed:
            await self._after_failed_formation(generation, forming.failed)
            return False
        if any(self.membership.members.get(mb.worker_id) is not mb or mb.state != "ready" for mb in ranked):
            return False  # a member left or registered again meanwhile: form again
        self.generation, self.ranked, self.layout = generation, ranked, layout
        self.holders = {mb.worker_id for mb in ranked}
        self.shards = {mb.worker_id: (layout.tp, rank % layout.tp) for rank, mb in enumerate(ranked)}
        self.committed = dict(forming.checksums.get(master.worker_id, {})) if layout.tp == 1 else {}
        self.scheduler.tell(Committed(layout.models, dict(self.committed)))
        self.scheduler.tell(Formed(self.group_id, tuple(mb.worker_id for mb in ranked)))
        self._join_failures.clear()
        log.info("%s: generation %d formed: %s", self.group_id, generation, ", ".join(mb.worker_id for mb in ranked))
        return True

    def _adopt_rejoined(self, members: list[Member], adapters: list[m.AdapterSpec]) -> None:
        """No survivor holds the state, but a worker that registered again (after it was declared dead while
        alive, or after the coordinator restarted) may: if it holds every adapter as last committed, or one
        committed cycle further, it is the source instead of a checkpoint."""
        if {spec.model_id for spec in adapters} - self._keep_committed(adapters).keys():
            return
        for member in members:
            recovered = adoptable(member, self.committed)
            if recovered is None:
                continue
            log.warning("no holder of the runs' state survived, but %s registered again holding all %d "
                        "adapter(s) as last committed%s: it is the source", member.worker_id, len(adapters),
                        f" (its last cycle: {member.last_cycle.cycle_id})" if member.last_cycle else "")
            if recovered:
                self.scheduler.tell(Recovered(recovered))
                self.committed = dict(member.holdings)
            self.holders = {member.worker_id}
            return

    def _keep_committed(self, adapters: list[m.AdapterSpec]) -> dict[str, float]:
        """Keep the checksums of this group's adapters only (the state dir's are every group's); returns them."""
        mine = {spec.model_id for spec in adapters}
        self.committed = {model_id: value for model_id, value in self.committed.items() if model_id in mine}
        return self.committed

    async def _after_failed_formation(self, generation: int, failed: set[str]) -> None:
        """Members that cannot be reached are dead; one that keeps failing to join is dropped; then retry."""
        for worker_id in failed:
            member = self.membership.members.get(worker_id)
            if member is None or member.state == "dead":
                continue
            self._join_failures[worker_id] = self._join_failures.get(worker_id, 0) + 1
            if not await self.probe(member) or self._join_failures[worker_id] >= 3:
                self.membership.mark_dead(worker_id, f"could not join generation {generation}")
        self._stale = True

    def _restore_from_checkpoints(self, adapters: list[m.AdapterSpec]) -> tuple[list[m.AdapterSpec], dict[str, m.CheckpointState]]:
        kept, restore, lost = [], {}, []
        for spec in adapters:
            path = self.latest_checkpoint(spec.model_id)
            if path is None:
                lost.append(spec.model_id)
                continue
            restore[spec.model_id] = self.load_state(path)
            kept.append(spec)
            log.warning("the worker pool was lost: %s restores from %s", spec.model_id, path)
        if lost:
            self.scheduler.tell(RunsLost(tuple(lost)))
        return kept, restore

    def reconfigured(self, worker_id: str, done: m.Reconfigured) -> None:
        forming = self.forming
        if forming is None or done.generation != forming.generation or worker_id not in forming.waiting:
            return
        forming.waiting.discard(worker_id)
        if done.error is not None:
            log.error("worker %s could not join generation %d: %s", worker_id, done.generation, done.error)
            forming.failed.add(worker_id)
        forming.checksums[worker_id] = done.checksums
        if not forming.waiting:
            forming.done.set()
