"""The coordinator's watchdog: queues that make no progress are reported, idle sessions close."""

from __future__ import annotations

import time

from bios import messages as m
from bios import types as t
from bios.coordinator.front_door import FrontDoor
from bios.coordinator.runs import Queued, Run
from bios.coordinator.store import Store


def _run_with(queue: dict[int, Queued], next_seq: int) -> Run:
    run = Run("s:train:0", "s", "alice", "bios/tiny-llama", t.LoraConfig(rank=4, seed=1), status="ready",
              next_seq=next_seq)
    run.queue.update(queue)
    return run


def test_a_queue_behind_a_missing_seq_id_is_reported_with_the_gap():
    old = time.monotonic() - 600
    run = _run_with({3: Queued("s:train:0#3", m.OptimStep("s:train:0", 3, t.AdamParams()), queued_at=old)}, 2)
    why = run.stalled(300)
    assert why is not None and "seq_id 2" in why and "never arrived" in why
    assert run.stalled(900) is None  # not that old yet
    runnable = _run_with({2: Queued("s:train:0#2", m.OptimStep("s:train:0", 2, t.AdamParams()), queued_at=old)}, 2)
    assert "waited" in runnable.stalled(300) and "never arrived" not in runnable.stalled(300)
    assert _run_with({}, 2).stalled(0) is None


def test_sessions_nobody_hears_from_are_closed(tmp_path):
    store = Store(tmp_path)
    door = FrontDoor(store, scheduler=None, queries=None, ledger=None, codec=None, capabilities=None, status=None)
    idle, alive = door.open_session("alice"), door.open_session("alice")
    door.seen[idle] -= 1000
    assert door.expire_sessions(600) == [idle]
    assert not door.heartbeat(idle, "alice")  # closed: a client coming back is told so
    assert door.heartbeat(alive, "alice")
    store.close()


def test_requests_behind_a_gap_that_never_fills_are_withdrawn_naming_the_seq_id():
    old = time.monotonic() - 600
    queued = Queued("s:train:0#4", m.OptimStep("s:train:0", 4, t.AdamParams()), queued_at=old)
    refused = Queued("s:train:0#3", None, rejected=True)
    run = _run_with({3: refused, 4: queued}, 2)
    assert run.expire_gap(120) == []  # it progressed just now (it was created)
    run.progressed_at = old
    withdrawn = run.expire_gap(120)
    assert [q for q, _ in withdrawn] == [queued] and "seq_id 2 never arrived" in withdrawn[0][1]
    assert run.queue == {3: refused}  # a refused seq_id stays used up
    assert _run_with({2: queued}, 2).expire_gap(0) == []  # runnable: no gap
