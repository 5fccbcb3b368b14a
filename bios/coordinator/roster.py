"""What the groups' cycle runners share: which worker each is busy with, one numbering of generations, which
worker holds which adapter as last committed, and a change signal.

The placement moves a worker from one group to another at once, but the worker may still be inside the old
group's cycle or formation: the new group takes it only when the old one has let it go (`busy_elsewhere`).
Generation numbers come from one counter (cycle ids from the scheduler's), so a late report from a worker that
changed groups never matches the new group's generation or cycle.

A worker that changes groups with a base model (the placement moves the model out of a group it shared) still
holds that model's adapters as its old group last committed them: the new group takes them from it
(`source`, whole adapters; `shard_of`, a split group's shards) instead of from checkpoints, so nothing trained
since the last checkpoint is lost.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

log = logging.getLogger(__name__)


class Roster:
    def __init__(self) -> None:
        self.version = 0
        self._changed = asyncio.Event()
        self._generations = itertools.count(1)
        self._busy: dict[str, str] = {}  # worker id -> the group running a cycle or formation with it
        self._wanted: set[str] = set()  # busy workers another group waits for
        self._committed: dict[str, float] = {}  # whole adapter -> its checksum as its group last committed it
        self._held: dict[str, dict[str, float]] = {}  # worker -> the whole adapters it holds, as it committed them
        # worker -> (its membership entry, tp, shard, base models) as its last split generation formed
        self._shards: dict[str, tuple[Any, int, int, frozenset[str]]] = {}

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

    def formed(self, workers: list[str], checksums: dict[str, float]) -> None:
        """A generation of `workers` formed holding exactly these whole adapters ({} under tensor parallelism:
        a shard is no whole adapter's source)."""
        self._committed.update(checksums)
        for worker in workers:
            self._held[worker] = dict(checksums)
            self._shards.pop(worker, None)

    def formed_shards(self, ranked: list[Any], tp: int, models: tuple[str, ...]) -> None:
        """A split generation of `ranked` members (membership entries, rank order) formed: rank i holds shard
        i % tp of the adapters of `models`."""
        for rank, member in enumerate(ranked):
            self._shards[member.worker_id] = (member, tp, rank % tp, frozenset(models))

    def shard_of(self, member: Any, models: set[str]) -> tuple[int, int] | None:
        """(tp, shard) of the adapters of `models` that `member` (this very registration) holds as its last split
        generation formed them, if it does."""
        entry = self._shards.get(member.worker_id)
        if entry is None or entry[0] is not member or not models <= entry[3]:
            return None
        return entry[1], entry[2]

    def committed(self, workers: list[str], checksums: dict[str, float]) -> None:
        """A cycle of `workers` committed these whole adapters."""
        self._committed.update(checksums)
        for worker in workers:
            self._held.setdefault(worker, {}).update(checksums)

    def unknown(self, model_ids: list[str]) -> None:
        """A cycle that trained these aborted: what its members hold is unknown until their group forms again."""
        for model_id in model_ids:
            self._committed.pop(model_id, None)

    def source(self, model_id: str, workers: list[str]) -> str | None:
        """The first of `workers` holding `model_id` whole as last committed, if any."""
        want = self._committed.get(model_id)
        if want is None:
            return None
        return next((worker for worker in workers if self._held.get(worker, {}).get(model_id) == want), None)

    def changed(self, why: str) -> None:
        """Something the runners form generations from changed: each looks whether its own group did."""
        self.version += 1
        log.debug("roster %d: %s", self.version, why)
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed_since(self, version: int) -> None:
        while self.version == version:
            await self._changed.wait()
