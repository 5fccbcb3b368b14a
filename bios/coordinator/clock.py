"""The cycle clock: when the scheduler may start the next cycle.

With `cycle_s > 0` ticks fall on a fixed grid (`cycle_s` apart); work queued after a tick waits for the next one,
which is what makes pipelining pay. With `cycle_s == 0` a cycle starts as soon as work is queued and the previous
cycle has ended (embedded mode and tests).
"""

from __future__ import annotations

import asyncio
import time


class CycleClock:
    def __init__(self, cycle_s: float) -> None:
        if cycle_s < 0:
            raise ValueError(f"cycle_s must be >= 0, got {cycle_s}")
        self.cycle_s = cycle_s
        self.cycles_run = 0
        self.busy_s = 0.0
        self._work = asyncio.Event()
        self._origin = time.monotonic()

    def work_queued(self) -> None:
        self._work.set()

    async def next_tick(self) -> None:
        """Wait for the next moment a cycle may start: work is queued and the tick has come."""
        await self._work.wait()
        if self.cycle_s > 0:
            elapsed = time.monotonic() - self._origin
            wait = self.cycle_s - (elapsed % self.cycle_s)
            await asyncio.sleep(wait)
        self._work.clear()

    def cycle_ran(self, duration_s: float) -> None:
        self.cycles_run += 1
        self.busy_s += duration_s
