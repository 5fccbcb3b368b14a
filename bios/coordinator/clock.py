"""The cycle clock: when the scheduler may start the next cycle.

With `cycle_s > 0` ticks fall on a fixed grid (`cycle_s` apart); work queued after a tick waits for the next one,
which is what makes pipelining pay. With `cycle_s == 0` a cycle starts as soon as work is queued and the previous
cycle has ended (embedded mode and tests); work that finds the clock idle waits while more keeps coming, so
requests sent together (an RL step's prompts) run in one cycle rather than the first alone and the rest a
whole cycle later.
"""

from __future__ import annotations

import asyncio
import math
import time

# Back-to-back cycles: after work arrives at an idle clock, the cycle waits while more arrives at most
# BURST_GAP_S apart, up to BURST_MAX_S in all. 16 concurrent `sample` calls from one client reach the
# coordinator within a few milliseconds; without the wait the first ran alone in 1 of 3 rounds
# (16 x 32 tokens: 1.7x slower).
BURST_GAP_S = 0.003
BURST_MAX_S = 0.05


class CycleClock:
    def __init__(self, cycle_s: float) -> None:
        if cycle_s < 0:
            raise ValueError(f"cycle_s must be >= 0, got {cycle_s}")
        self.cycle_s = cycle_s
        self.cycles_run = 0
        self.busy_s = 0.0
        self._work = asyncio.Event()
        self._arrivals = 0
        self._origin = time.monotonic()

    def work_queued(self) -> None:
        self._arrivals += 1
        self._work.set()

    async def next_tick(self) -> None:
        """Wait for the next moment a cycle may start: work is queued and the tick has come."""
        idle = not self._work.is_set()
        await self._work.wait()
        if self.cycle_s > 0:
            elapsed = time.monotonic() - self._origin
            wait = self.cycle_s - (elapsed % self.cycle_s)
            await asyncio.sleep(wait)
        elif idle:
            await self._burst()
        self._work.clear()

    async def _burst(self) -> None:
        """Wait while work keeps arriving (see BURST_GAP_S)."""
        deadline = time.monotonic() + BURST_MAX_S
        while time.monotonic() < deadline:
            seen = self._arrivals
            await asyncio.sleep(BURST_GAP_S)
            if self._arrivals == seen:
                return

    async def replies(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for work to arrive, then while more keeps coming (`_burst`): the next calls of
        the clients a cycle just answered."""
        seen, deadline = self._arrivals, time.monotonic() + timeout_s
        while self._arrivals == seen and time.monotonic() < deadline:
            await asyncio.sleep(BURST_GAP_S)
        if self._arrivals != seen:
            await self._burst()

    def held_for(self, duration_s: float) -> float:
        """How long a cycle that ran `duration_s` holds the group: on a grid, until the next tick after it."""
        if self.cycle_s <= 0:
            return duration_s
        return max(1, math.ceil(duration_s / self.cycle_s)) * self.cycle_s

    def cycle_ran(self, duration_s: float) -> None:
        self.cycles_run += 1
        self.busy_s += duration_s
