"""The coordinator's timers: workers whose heartbeats stopped, queues that make no progress, idle sessions.

Liveness is judged only on time the coordinator itself was awake: after a stall (a pause, a slow disk, an
overloaded host) every worker gets a fresh heartbeat timeout, since its heartbeats wait unread in the socket.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from bios.actors.actor import ActorRef
from bios.cluster_defaults import PROGRESS_EVERY_S

from .front_door import FrontDoor

NO_WORKER = ("no worker is connected (the cluster's workers left or died): it runs when one joins; `bios status` "
             "shows the workers, and `bios-worker --coordinator ADDRESS` starts one")
# Before any worker joined: `bios up`'s own workers may still be starting (loading their models).
NO_WORKER_YET = ("no worker has joined yet: it runs when one does (workers that `bios up` started join once they "
                 "have started; elsewhere start one with `bios-worker --coordinator ADDRESS`)")
from .membership import Membership
from .scheduler import Scheduler

log = logging.getLogger(__name__)


class Watchdog:
    def __init__(self, membership: Membership, runner: Any, scheduler: ActorRef, front_door: FrontDoor, *,
                 heartbeat_timeout_s: float, session_timeout_s: float, stalled_after_s: float,
                 seq_gap_s: float) -> None:
        self.membership = membership
        self.runner = runner
        self.scheduler = scheduler
        self.front_door = front_door
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.session_timeout_s = session_timeout_s
        self.stalled_after_s = stalled_after_s
        self.seq_gap_s = seq_gap_s

    async def watch_heartbeats(self) -> None:
        """Declare dead the workers whose heartbeats stopped, judging only time this coordinator was awake."""
        interval = min(0.5, self.heartbeat_timeout_s / 4)
        stall = self.heartbeat_timeout_s / 2
        last = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            if now - last > interval + stall:
                log.warning("the coordinator stalled for %.1fs (a pause, a slow disk or an overloaded host): "
                            "workers get a fresh %.1fs to be heard from", now - last - interval,
                            self.heartbeat_timeout_s)
                self.membership.grace()
            last = now
            for member in self.membership.expire():
                self.runner.worker_lost(member)

    async def watch_gaps(self) -> None:
        """Requests waiting behind a seq_id that never came are withdrawn after `seq_gap_s`, so no run is held
        forever by a lost request (their clients are told which seq_id to resend)."""
        while True:
            await asyncio.sleep(min(1.0, self.seq_gap_s / 4))
            await self.scheduler.ask(Scheduler.expire_gaps, self.seq_gap_s)

    async def watch_progress(self) -> None:
        """Report queues that make no progress, close sessions nobody heard from for the session timeout and
        delete checkpoints whose TTL ran out."""
        interval = min(PROGRESS_EVERY_S, self.stalled_after_s / 2)
        while True:
            await asyncio.sleep(interval)
            for why in await self.scheduler.ask(Scheduler.stalled, self.stalled_after_s):
                log.warning("no progress: %s", why)
            waiting = sum((await self.scheduler.ask(Scheduler.queue_depths)).values())
            if waiting and not self.membership.alive():
                why = NO_WORKER if self.membership.members else NO_WORKER_YET
                log.warning("%d request(s) wait: %s", waiting, why)
                await self.scheduler.ask(Scheduler.notify_waiting, why)
            for session_id in self.front_door.expire_sessions(self.session_timeout_s):
                log.info("session %s closed: nothing heard from it for %.0fs", session_id, self.session_timeout_s)
            for path in self.front_door.expire_checkpoints():
                log.info("checkpoint %s deleted: its TTL ran out", path)
