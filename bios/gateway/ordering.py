"""Per-run `seq_id` order at the gateway: requests are handed to the coordinator strictly in order.

A Tinker client sends one call's chunks concurrently (the first chunk last), so chunk k+1 can arrive before
chunk k. The gateway holds such early requests and hands them on once the gap before them fills. A gap that
never fills (a lost request, a broken client) must not hold a run forever: after `gap_timeout_s` without
progress the held requests are failed and reported, and nothing of them reached the coordinator.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Run:
    next_seq: int
    held: dict[int, Any] = field(default_factory=dict)
    timer: asyncio.TimerHandle | None = None


# Called with (model_id, missing seq_id, held ops) when a gap times out.
OnGapTimeout = Callable[[str, int, list[Any]], None]


class SeqGate:
    """Orders the requests of runs created through this gateway; runs it did not create pass straight through."""

    def __init__(self, gap_timeout_s: float, on_gap_timeout: OnGapTimeout) -> None:
        self.gap_timeout_s = gap_timeout_s
        self.on_gap_timeout = on_gap_timeout
        self._runs: dict[str, _Run] = {}

    def open(self, model_id: str, next_seq: int = 1) -> None:
        """Start ordering a run (after its create request, seq 0, went through); a repeated open is a no-op."""
        self._runs.setdefault(model_id, _Run(next_seq))

    def admit(self, model_id: str, seq_id: int, op: Any) -> list[Any]:
        """The ops to hand on now, in order (`op` first), or [] when `op` waits for an earlier seq_id.

        A seq_id below the next expected one is a resubmission and passes through: the coordinator answers it
        from its stored result.
        """
        run = self._runs.get(model_id)
        if run is None or seq_id < run.next_seq:
            return [op]
        if seq_id > run.next_seq:
            run.held.setdefault(seq_id, op)
            self._arm(model_id, run)
            return []
        ready = [op]
        run.next_seq += 1
        while run.next_seq in run.held:
            ready.append(run.held.pop(run.next_seq))
            run.next_seq += 1
        if run.timer is not None:
            run.timer.cancel()
            run.timer = None
        if run.held:
            self._arm(model_id, run)
        return ready

    def rewind(self, model_id: str, seq_id: int, later: list[tuple[int, Any]]) -> None:
        """Take back requests handed on but refused outright: `seq_id` is next again, `later` wait behind it."""
        run = self._runs.get(model_id)
        if run is None:
            return
        run.next_seq = min(run.next_seq, seq_id)
        for later_seq, item in later:
            run.held.setdefault(later_seq, item)
        if run.held:
            self._arm(model_id, run)

    def _arm(self, model_id: str, run: _Run) -> None:
        """Start the gap clock when a run starts waiting, and again after each bit of progress."""
        if run.timer is None:
            run.timer = asyncio.get_running_loop().call_later(self.gap_timeout_s, self._expire, model_id)

    def _expire(self, model_id: str) -> None:
        run = self._runs[model_id]
        run.timer = None
        ops = [run.held[seq] for seq in sorted(run.held)]
        run.held.clear()
        self.on_gap_timeout(model_id, run.next_seq, ops)

    def close(self) -> None:
        for run in self._runs.values():
            if run.timer is not None:
                run.timer.cancel()
        self._runs.clear()
