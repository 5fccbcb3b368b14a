"""The cycle clock with back-to-back cycles (`cycle_s == 0`): work that finds it idle waits while more keeps
arriving, so a burst of requests runs in one cycle; work queued while a cycle runs starts the next at once."""

from __future__ import annotations

import asyncio

import pytest

from bios.coordinator import clock as clock_module
from bios.coordinator.clock import CycleClock


def test_a_burst_arriving_at_an_idle_clock_is_waited_for(monkeypatch):
    monkeypatch.setattr(clock_module, "BURST_GAP_S", 0.3)  # generous: arrivals below are 0.02 s apart
    monkeypatch.setattr(clock_module, "BURST_MAX_S", 30.0)

    async def scenario() -> list[str]:
        clock, events = CycleClock(0), []

        async def tick() -> None:
            await clock.next_tick()
            events.append("tick")

        waiting = asyncio.ensure_future(tick())
        await asyncio.sleep(0)
        for n in range(5):
            clock.work_queued()
            events.append(f"arrival {n}")
            await asyncio.sleep(0.02)
        await waiting
        return events

    assert asyncio.run(scenario()) == [f"arrival {n}" for n in range(5)] + ["tick"]


def test_a_burst_waits_no_longer_than_the_cap(monkeypatch):
    monkeypatch.setattr(clock_module, "BURST_GAP_S", 0.01)
    monkeypatch.setattr(clock_module, "BURST_MAX_S", 0.05)

    async def scenario() -> None:
        clock = CycleClock(0)
        waiting = asyncio.ensure_future(clock.next_tick())
        while not waiting.done():  # work keeps arriving faster than the gap
            clock.work_queued()
            await asyncio.sleep(0.001)

    asyncio.run(asyncio.wait_for(scenario(), timeout=30))


def test_work_queued_during_a_cycle_starts_the_next_at_once(monkeypatch):
    monkeypatch.setattr(clock_module, "BURST_GAP_S", 60.0)  # a wait would outlast the timeout below
    monkeypatch.setattr(clock_module, "BURST_MAX_S", 60.0)

    async def scenario() -> None:
        clock = CycleClock(0)
        clock.work_queued()  # queued while the previous cycle ran: the clock is not idle
        await asyncio.wait_for(clock.next_tick(), timeout=5)

    asyncio.run(scenario())


def test_a_negative_cycle_length_is_refused():
    with pytest.raises(ValueError, match="cycle_s must be >= 0"):
        CycleClock(-1)


def test_a_cycle_holds_a_grid_clocks_group_until_the_next_tick():
    """What a cut request's added cycles cost (bios.coordinator.cycle_share): on a grid, a whole tick each."""
    assert CycleClock(0).held_for(0.04) == 0.04  # back to back: its own time
    assert CycleClock(10).held_for(0.04) == 10
    assert CycleClock(10).held_for(25) == 30
