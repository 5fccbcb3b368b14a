"""Whether a worker that registers again holds the runs' current state, so it can be their source.

A worker keeps its adapters when it is wrongly declared dead or when the coordinator restarts; it reports each
adapter's checksum and what it kept of the last cycle it committed. It is current if it holds every adapter as
last committed, or exactly one committed cycle further: then the coordinator records that cycle's results from
the worker instead of running it again, so every step happens exactly once.
"""

from __future__ import annotations

from bios import messages as m

from .membership import Member


def adoptable(member: Member, committed: dict[str, float]) -> tuple[m.ItemDone, ...] | None:
    """The results of `member`'s last committed cycle if it holds every adapter as `committed` or one committed
    cycle further (the scheduler records those the log lacks and ignores the rest); None if it cannot be the
    source."""
    if not committed:
        return None
    held = member.last_cycle
    results = tuple(held.results) if held is not None else ()
    if all(member.holdings.get(model_id) == checksum for model_id, checksum in committed.items()):
        return results
    if held is None or set(member.holdings) != set(committed):
        return None
    if all(checksum in (member.holdings[model_id], held.before.get(model_id))
           for model_id, checksum in committed.items()):
        return results
    return None
