"""Which workers are alive: registration, heartbeats, and generations.

Every change of the live set (a join, a leave, a death) starts a new generation; cycles are always run by the
members of one generation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from bios import messages as m

log = logging.getLogger(__name__)


@dataclass
class Member:
    worker_id: str
    peer: bytes
    host: str
    pid: int
    device: str
    memory_bytes: int
    models: list[str] = field(default_factory=list)
    store_host: str = "127.0.0.1"
    store_port: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    state: str = "ready"  # ready | leaving | dead
    sampler_paths: set[str] = field(default_factory=set)  # sampler checkpoints this worker holds in memory
    runtime_bytes: int = 0  # the worker's own footprint before any model (memory plans count it as overhead)
    holdings: dict[str, float] = field(default_factory=dict)  # adapter checksums it held when it registered
    last_cycle: m.HeldCycle | None = None  # the last cycle it committed before registering (again)


class Membership:
    def __init__(self, heartbeat_timeout_s: float) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.members: dict[str, Member] = {}
        self.generation = 0
        self._changed = asyncio.Event()

    def register(self, peer: bytes, msg: m.RegisterWorker) -> Member:
        member = Member(msg.worker_id, peer, msg.host, msg.pid, msg.device, msg.memory_bytes, list(msg.models),
                        msg.store_host, msg.store_port, runtime_bytes=msg.runtime_bytes,
                        holdings=dict(msg.holdings), last_cycle=msg.last_cycle)
        self.members[msg.worker_id] = member
        self.bump(f"worker {msg.worker_id} joined ({msg.device}, pid {msg.pid} on {msg.host})")
        return member

    def heartbeat(self, worker_id: str, peer: bytes) -> bool:
        member = self.members.get(worker_id)
        if member is None or member.state == "dead" or member.peer != peer:
            return False
        member.last_seen = time.monotonic()
        return True

    def mark_leaving(self, worker_id: str, reason: str) -> Member | None:
        member = self.members.get(worker_id)
        if member is not None and member.state == "ready":
            member.state = "leaving"
            self.bump(f"worker {worker_id} is leaving: {reason}")
        return member

    def mark_dead(self, worker_id: str, reason: str) -> None:
        member = self.members.get(worker_id)
        if member is not None and member.state != "dead":
            member.state = "dead"
            self.bump(f"worker {worker_id} lost: {reason}")

    def expire(self) -> list[Member]:
        """Mark members whose heartbeats stopped as dead; returns them."""
        limit = time.monotonic() - self.heartbeat_timeout_s
        dead = [mb for mb in self.members.values() if mb.state != "dead" and mb.last_seen < limit]
        for member in dead:
            self.mark_dead(member.worker_id, f"no heartbeat for {self.heartbeat_timeout_s:.1f}s")
        return dead

    def grace(self) -> None:
        """Count every live member as just heard from: after the coordinator itself stalled, silence says
        nothing about the workers, whose heartbeats wait unread in its socket."""
        now = time.monotonic()
        for member in self.members.values():
            if member.state != "dead":
                member.last_seen = now

    def alive(self) -> list[Member]:
        return [mb for mb in self.members.values() if mb.state == "ready"]

    async def changed_since(self, generation: int) -> None:
        while self.generation == generation:
            await self._changed.wait()

    def status(self, active: set[str], parked: Mapping[str, str],
               placed: Mapping[str, tuple[str, ...]]) -> list[m.WorkerStatus]:
        """`active` members are in their group's generation; `waiting` ones are `parked` (no group can use them:
        the note says why); `joining` ones are `placed` in a group (with its base models) but not yet in its
        generation; `idle` ones are in no group because no run needs them yet."""
        now = time.monotonic()
        return [
            m.WorkerStatus(mb.worker_id, mb.host, mb.pid, mb.device, self._state(mb, active, parked, placed),
                           now - mb.last_seen, parked.get(mb.worker_id, "") if mb.state == "ready" else "",
                           list(placed.get(mb.worker_id, ())) if mb.state == "ready" else [], mb.memory_bytes)
            for mb in self.members.values()
        ]

    @staticmethod
    def _state(member: Member, active: set[str], parked: Mapping[str, str],
               placed: Mapping[str, tuple[str, ...]]) -> str:
        if member.state != "ready":
            return member.state
        if member.worker_id in parked:
            return "waiting"
        if member.worker_id in active:
            return "active"
        return "joining" if member.worker_id in placed else "idle"

    def bump(self, why: str) -> None:
        """Start a new generation (the cycle runner re-forms the group before the next cycle)."""
        self.generation += 1
        log.info("generation %d: %s", self.generation, why)
        self._changed.set()
        self._changed = asyncio.Event()  # waiters hold the event that was current; the next change gets a new one
