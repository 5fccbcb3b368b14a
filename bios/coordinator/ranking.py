"""Who takes which rank in a new generation, and how the runs' state reaches them."""

from __future__ import annotations

import logging

from .membership import Member

log = logging.getLogger(__name__)


def rank_members(members: list[Member], tp: int, holder_ids: set[str], shards: dict[str, tuple[int, int]],
                 current_tp: int) -> tuple[list[Member], int | None]:
    """The members of the next generation in rank order, and how the state reaches them: the `source_tp`
    of `Reconfigure` (1: whole on rank 0; tp: shard j on rank j, and so when the last generation was split
    another number of ways: its shard j on rank j, put together and cut anew), or None when no survivor can.

    Survivors keep their shard where they can (no reload); members beyond a multiple of `tp` stand by.
    """
    holders = [mb for mb in members if mb.worker_id in holder_ids]
    others = [mb for mb in members if mb.worker_id not in holder_ids]
    size = len(members) // tp * tp
    if current_tp == 1:  # the holders have whole adapters (or there are none): rank 0 sends them, cut if tp > 1
        return (holders + others)[:size], 1 if holders else None
    if current_tp != tp:  # shard j's holder takes rank j: they put each adapter together, then it is cut anew
        chosen = [next((mb for mb in holders if shards.get(mb.worker_id) == (current_tp, j)), None)
                  for j in range(current_tp)]
        if any(mb is None for mb in chosen) or size < current_tp:
            if holders:
                log.error("no survivor holds every shard of the adapters held over %d worker(s): they restore from "
                          "their latest automatic checkpoints", current_tp)
            return (holders + others)[:size], None
        rest = [mb for mb in holders + others if mb not in chosen]
        return (chosen + rest)[:size], current_tp
    by_shard = [[mb for mb in holders if shards.get(mb.worker_id) == (tp, j)] for j in range(tp)]
    ranked: list[Member] = []
    placed: set[str] = set()
    for rank in range(size):
        pick = next((mb for mb in by_shard[rank % tp] if mb.worker_id not in placed), None)
        if pick is None:
            pick = next(mb for mb in [*others, *holders] if mb.worker_id not in placed)
        ranked.append(pick)
        placed.add(pick.worker_id)
    return ranked, tp if all(by_shard) else None
