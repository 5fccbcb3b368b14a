"""What the groups' cycle runners share: which worker each is busy with, one numbering of generations, and a
change signal.

The placement moves a worker from one group to another at once, but the worker may still be inside the old
group's cycle or formation: the new group takes it only when the old one has let it go (`busy_elsewhere`).
Generation numbers come from one counter (cycle ids from the scheduler's), so a late report from a worker that
changed groups never matches the new group's generation or cycle.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

log = logging.getLogger(__name__)


class Roster:
    def __init__(self) -> None:
        self.version = 0
        self._changed = asyncio.Event()
        self._generations = itertools.count(1)
        self._busy: dict[str, str] = {}  # worker id -> the group running a cycle or formation with it
        self._wanted: set[str] = set()  # busy workers another group waits for

    def next_generation(self) -> int:
        return next(self._generations)

    def occupy(self, group_id: str, workers: list[str]) -> None:
        for worker in workers:
            self._busy[worker] = group_id

    def release(self, group_id: str) -> None:
        """`group_id`'s cycle or formation is over: its workers are free for another group to take."""
        freed = [worker for worker, group in self._busy.items() if group == group_id]
        for worker in freed:
            del self._busy[worker]
        handed = self._wanted.intersection(freed)
        if handed:
            self._wanted -= handed
            self.changed(f"{group_id}'s group let go of {', '.join(sorted(handed))}")

    def busy_elsewhere(self, worker_id: str, group_id: str) -> bool:
        """Whether another group still runs a cycle or formation with `worker_id` (it is then told when not)."""
        busy = self._busy.get(worker_id, group_id) != group_id
        if busy:
            self._wanted.add(worker_id)
        return busy

    def changed(self, why: str) -> None:
        """Something the runners form generations from changed: each looks whether its own group did."""
        self.version += 1
        log.debug("roster %d: %s", self.version, why)
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed_since(self, version: int) -> None:
        while self.version == version:
            await self._changed.wait()
