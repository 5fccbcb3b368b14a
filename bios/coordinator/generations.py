"""Forms one group's generations: which workers are its members, in which rank order, and how every adapter's
state reaches them (`bios.coordinator.ranking`, `bios.coordinator.adoption`).

A new generation is formed when the group's members (the placement's, once no other group still runs a cycle
with them) or its layout change, or when the cycle runner asks for a rebuild (a collective failed, replicas
diverged). Ranks are assigned, rank 0 is a worker that already holds the current state, and every member takes
each adapter's state from it by broadcast; under tensor parallelism rank j of replica 0 is a holder of shard j.
If no member holds the state, a worker that registered again holding it as last committed is the source
(after a coordinator restart the first formation waits a little for one), else every adapter restores from its
latest automatic checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from bios import messages as m
from bios.actors.actor import ActorRef
from bios.cluster_defaults import COLLECTIVE_TIMEOUT_S

from .adoption import adoptable
from .exchange import GroupLayout
from .membership import Member, Membership
from .ranking import rank_members
from .roster import Roster
from .scheduler import Scheduler

log = logging.getLogger(__name__)

SendToWorker = Callable[[bytes, Any], Awaitable[None]]
LoadState = Callable[[str], m.CheckpointState]
LatestCheckpoint = Callable[[str], str | None]
Probe = Callable[[Member], Awaitable[bool]]

RECONFIGURE_TIMEOUT_S = 180.0  # newcomers may have to load base models first


class Abortable(Protocol):
    """A cycle or a formation: the members it still waits for, and whether they were told it is given up."""

    waiting: set[str]
    given_up: bool


@dataclass
class _Forming:
    generation: int
    waiting: set[str]
    failed: set[str] = field(default_factory=set)
    checksums: dict[str, dict[str, float]] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    given_up: bool = False  # its remaining members were told to abort it


class GenerationFormer:
    def __init__(self, group_id: str, scheduler: ActorRef, membership: Membership, roster: Roster,
                 send: SendToWorker, load_state: LoadState, latest_checkpoint: LatestCheckpoint, probe: Probe,
                 join_timeout_s: float, epoch: str, collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
                 committed: dict[str, float] | None = None, rejoin_grace_s: float = 0.0) -> None:
        self.group_id = group_id
        self.scheduler = scheduler
        self.membership = membership
        self.roster = roster
        self.send = send
        self.load_state = load_state
        self.latest_checkpoint = latest_checkpoint
        self.probe = probe
        self.join_timeout_s = join_timeout_s  # how long members wait for each other to join a generation
        self.collective_timeout_s = collective_timeout_s
        self.epoch = epoch  # the rendezvous keys of this coordinator's generations are its own
        self.forming: _Forming | None = None
        self.generation = -1
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
        self._settled_at = -1  # the roster version at which the generation was last found formed
        self._stale = False  # the same members must form again (a collective failed, replicas diverged)
        self._join_failures: dict[str, int] = {}

    def rebuild(self, why: str) -> None:
        """Form the group's generation again with the same members."""
        self._stale = True
        self.roster.changed(f"{self.group_id}: {why}")

    def after_cycle(self, aborted: bool, ops: dict[str, m.Request],
                    checksums: dict[str, dict[str, float]]) -> dict[str, float]:
        """Record the adapters' checksums after a cycle (rank 0's; an aborted cycle's adapters are unknown until
        the group is formed again); returns them, for the state dir."""
        if aborted:
            for op in ops.values():
                self.committed.pop(op.target, None)
            self.roster.unknown([op.target for op in ops.values()])
        elif self.ranked and self.layout.tp == 1:
            done = checksums.get(self.ranked[0].worker_id, {})
            self.committed.update(done)
            self.roster.committed([mb.worker_id for mb in self.ranked], done)
        return dict(self.committed)

    def abort_members(self, state: Abortable, generation: int, reason: str) -> None:
        """Tell the members still in a cycle or formation that it is given up (once): their collectives with
        the lost or failed member would otherwise wait out the collective timeout."""
        if state.given_up:
            return
        state.given_up = True
        for worker_id in state.waiting:
            member = self.membership.members.get(worker_id)
            if member is not None and member.state != "dead":
                asyncio.ensure_future(self.send(member.peer, m.AbortGeneration(self.epoch, generation, reason)))

    def worker_lost(self, member: Member) -> None:
        forming = self.forming
        if forming is not None and member.worker_id in forming.waiting:
            forming.waiting.discard(member.worker_id)
            forming.failed.add(member.worker_id)
            self.abort_members(forming, forming.generation, f"{member.worker_id} was lost")
            if not forming.waiting:
                forming.done.set()

    def settled_layout(self) -> GroupLayout | None:
        """The layout the current generation was formed for, while nothing it was formed from has changed
        (the roster, a member's life, a rebuild asked for); None when `settle` must look again."""
        if self._stale or self._rejoin_deadline or self.roster.version != self._settled_at or not self.ranked:
            return None
        if any(self.membership.members.get(mb.worker_id) is not mb or mb.state == "dead" for mb in self.ranked):
            return None
        return self.layout

    async def settle(self, layout: GroupLayout, adapters: tuple[m.AdapterSpec, ...]) -> None:
        """Form the generation for `layout` when its members (the placement's, once no other group still runs
        a cycle with them) or its layout changed, or when it must be rebuilt; or wait for enough workers, or
        after a coordinator restart for a worker that kept the state. The caller then asks for a new plan."""
        seen = self.roster.version
        live = {mb.worker_id: mb for mb in self.membership.alive()}
        members = [live[w] for w in layout.workers if w in live and not self.roster.busy_elsewhere(w, self.group_id)]
        if self._rejoin_deadline and await self._wait_for_rejoin(members, adapters, seen):
            return
        formed = (frozenset(id(mb) for mb in members), dataclasses.replace(layout, workers=()))
        if formed == self._formed and not self._stale:
            self.layout, self._settled_at = layout, seen
            return
        if len(members) < max(1, layout.tp):
            await self._wait_for_room(len(members), layout, seen)
            return
        if await self._form(members, layout, list(adapters)):
            self._formed, self._stale, self._settled_at = formed, False, seen

    async def _wait_for_room(self, serving: int, layout: GroupLayout, seen: int) -> None:
        """Too few workers for one replica: say why, then wait for the roster to change."""
        models = ", ".join(layout.models)
        if serving or layout.workers:
            log.warning("%s: %d worker(s) can serve, but its plan splits it over %d: waiting for more", models,
                        serving, layout.tp)
        else:
            log.warning("no live worker can hold %s", models)
            await self.scheduler.ask(Scheduler.notify_waiting,
                                     f"it waits for a worker with room for its base model ({models})", layout.models)
        await self.roster.changed_since(seen)

    async def _wait_for_rejoin(self, members: list[Member], adapters: tuple[m.AdapterSpec, ...], seen: int) -> bool:
        """After a coordinator restart, wait (a little) for a worker that kept the group's state to register
        again, so a newcomer that registers first does not make its runs restore from disk; True after a wait."""
        left = self._rejoin_deadline - time.monotonic()
        self._keep_committed(list(adapters))
        if left <= 0 or not self.committed or any(adoptable(mb, self.committed) is not None for mb in members):
            self._rejoin_deadline = 0.0
            return False
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.roster.changed_since(seen), left)
        return True

    async def _form(self, members: list[Member], layout: GroupLayout, adapters: list[m.AdapterSpec]) -> bool:
        generation = self.roster.next_generation()
        if adapters and layout.tp == self.layout.tp == 1 and not any(mb.worker_id in self.holders for mb in members):
            self._adopt_rejoined(members, adapters)
        held_tp = self.layout.tp
        if adapters and not any(mb.worker_id in self.holders for mb in members):
            held_tp = self._adopt_moved_shards(members, adapters) or held_tp
        ranked, source_tp = rank_members(members, layout.tp, self.holders, self.shards, held_tp)
        # No member holds these: no holder survived, or their base model joins a group formed without it (its own
        # group's workers are gone). They come from their checkpoints.
        unheld = adapters if source_tp is None else [
            spec for spec in adapters if self.layout.models and spec.base_model not in self.layout.models]
        sources = self._sources_elsewhere(ranked, unheld) if layout.tp == 1 else {}
        unheld = [spec for spec in unheld if spec.model_id not in sources]
        restore: dict[str, m.CheckpointState] = {}
        if unheld:
            kept, restore = self._restore_from_checkpoints(unheld)
            adapters = [spec for spec in adapters if spec not in unheld] + kept
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
                                                       self.epoch, self.collective_timeout_s, sources))
        try:
            await asyncio.wait_for(forming.done.wait(), RECONFIGURE_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("%s: generation %d not formed within %.0fs: %s never reported joining (`kill -USR1` on a "
                        "worker logs its threads' stacks)", self.group_id, generation, RECONFIGURE_TIMEOUT_S,
                        ", ".join(sorted(forming.waiting)))
            forming.failed |= forming.waiting
            self.abort_members(forming, generation, f"not formed within {RECONFIGURE_TIMEOUT_S:.0f}s")
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
        self.roster.formed(list(self.holders), self.committed)
        if layout.tp > 1:
            self.roster.formed_shards(ranked, layout.tp, layout.models)
        self.scheduler.tell(Scheduler.formed, self.group_id, tuple(mb.worker_id for mb in ranked), layout.models,
                            dict(self.committed))
        self._join_failures.clear()
        log.info("%s: generation %d formed: %s", self.group_id, generation, ", ".join(mb.worker_id for mb in ranked))
        return True

    def _sources_elsewhere(self, ranked: list[Member], unheld: list[m.AdapterSpec]) -> dict[str, int]:
        """The adapters no holder of this group provides that a member holds as last committed in another group
        (`Roster.source`: its base model moved here with it), each with that member's rank."""
        workers = [mb.worker_id for mb in ranked]
        found = {spec.model_id: source for spec in unheld if (source := self.roster.source(spec.model_id, workers))}
        for model_id, source in found.items():
            log.info("%s: %s comes from %s, which holds it as its last group committed it", self.group_id, model_id,
                     source)
        return {model_id: workers.index(source) for model_id, source in found.items()}

    def _adopt_moved_shards(self, members: list[Member], adapters: list[m.AdapterSpec]) -> int | None:
        """None of this group's holders is here, but members came from a split group that held these adapters
        (`_unshare` moved their base model out with them): they are the holders of their shards, as that group
        formed them (`Roster.shard_of`). Returns that group's tensor-parallel size, or None."""
        models = {spec.base_model for spec in adapters}
        found = {mb.worker_id: shard for mb in members if (shard := self.roster.shard_of(mb, models)) is not None}
        sizes = {tp for tp, _ in found.values()}
        if len(sizes) != 1:
            return None
        log.info("%s: %s hold the runs' state as shards of the split group they came from", self.group_id,
                 ", ".join(sorted(found)))
        self.holders, self.shards = set(found), dict(found)
        return sizes.pop()

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
                self.scheduler.tell(Scheduler.recovered, recovered)
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
            log.warning("no live worker holds %s any more: it restores from %s", spec.model_id, path)
        if lost:
            self.scheduler.tell(Scheduler.runs_lost, tuple(lost))
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
