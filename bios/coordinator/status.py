"""What the coordinator reports of the cluster: `bios status`, the console and the metrics read this
(`ClusterStatus`), and the Tinker SDK's server capabilities (the base models the live workers hold)."""

from __future__ import annotations

import time

from bios import messages as m
from bios import types as t
from bios.actors.actor import ActorRef

from .groups import Groups
from .membership import Membership
from .scheduler import Scheduler
from .store import Store


class ClusterView:
    def __init__(self, membership: Membership, groups: Groups, scheduler: ActorRef, store: Store,
                 cycle_s: float) -> None:
        self.membership = membership
        self.groups = groups
        self.scheduler = scheduler
        self.store = store
        self.cycle_s = cycle_s
        self.started = time.monotonic()

    async def status(self) -> m.ClusterStatus:
        groups = self.groups
        return m.ClusterStatus(
            cycles_run=groups.cycles_run,
            cycle_s=self.cycle_s,
            generation=self.membership.generation,
            workers=self.membership.status(active=groups.holders, parked=groups.parked, placed=groups.placed),
            queue_depth=sum((await self.scheduler.ask(Scheduler.queue_depths)).values()),
            runs=len(self.store.list_runs()),
            busy_s=groups.busy_s,
            uptime_s=time.monotonic() - self.started,
            phase_seconds=dict(groups.phase_seconds),
            plans=await self.scheduler.ask(Scheduler.plan_descriptions),
            longest_rows=await self.scheduler.ask(Scheduler.longest_rows),
            longest_forward_rows=await self.scheduler.ask(Scheduler.longest_rows, True),
            state_dir=self.store.disk.space(),
            groups=groups.group_status(),
            placement_notes=[*groups.placement.reasons, *(f"{model} waits: {why}"
                                                          for model, why in groups.placement.unplaced)],
        )

    def capabilities(self) -> t.GetServerCapabilitiesResponse:
        names = sorted({name for member in self.membership.alive() for name in member.models})
        return t.GetServerCapabilitiesResponse([t.SupportedModel(model_name=name) for name in names],
                                               cycle_s=self.cycle_s)
