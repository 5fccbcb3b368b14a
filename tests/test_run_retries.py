"""What an aborted cycle does to a run's queue (`Run.cycle_aborted`): unfinished requests go back in order;
deaths and stalls are counted apart, and the second of either gives the request up with its own message
(`bios.coordinator.retries`); a run whose request stalled runs alone next (`Run.runs_alone`)."""

from __future__ import annotations

from bios import messages as m
from bios import types as t
from bios.coordinator.retries import killed_twice, stalled_twice
from bios.coordinator.runs import Queued, Run


def _run_with_a_cycle_in_flight() -> tuple[Run, Queued, Queued]:
    run = Run("m", "s", "owner", "bios/tiny-llama", t.LoraConfig(rank=8))
    datum = t.Datum(t.ModelInput.from_ints([1, 2, 3]), {"target_tokens": [2, 3, 4]})
    forward = Queued("m:0", m.ForwardBackward("m", 0, [datum], "cross_entropy"))
    step = Queued("m:1", m.OptimStep("m", 1, t.AdamParams()))
    run.enqueue(0, forward)
    run.enqueue(1, step)
    assert run.take_cycle() == [forward, step]
    return run, forward, step


def test_a_stall_returns_the_unfinished_requests_and_the_run_runs_alone_then_the_second_gives_them_up():
    run, forward, step = _run_with_a_cycle_in_flight()
    assert not run.runs_alone()
    returned = run.cycle_aborted({"m:0"}, stalled=True)  # the forward_backward finished before the abort
    assert returned.retried == [step] and returned.given_up == []
    assert run.next_seq == 1 and run.runs_alone() and step.stalls == 1 and step.deaths == 0
    assert run.take_cycle() == [step]
    returned = run.cycle_aborted(set(), stalled=True)
    assert returned.given_up == [step] and returned.retried == []
    assert run.queue[1].rejected  # its seq_id is used up: the queue moves past it
    assert run.take_cycle() == [] and run.next_seq == 2


def test_deaths_and_stalls_count_apart_and_each_gives_up_with_its_own_reason():
    run, forward, step = _run_with_a_cycle_in_flight()
    assert run.cycle_aborted(set(), worker_died=True).retried == [forward, step]
    run.take_cycle()
    returned = run.cycle_aborted(set(), stalled=True)
    assert returned.given_up == [] and (forward.deaths, forward.stalls) == (1, 1)
    run.take_cycle()
    returned = run.cycle_aborted(set(), worker_died=True)
    assert returned.given_up == [forward, step]
    assert "workers died twice while running m:0 (ForwardBackward, 3 tokens in 1 rows (the longest 3))" in \
        killed_twice(forward, [2**30])
    message = stalled_twice(step, "w1: collective failed: Timed out")
    assert message.startswith("m:1 (OptimStep) was in two cycles that aborted with every worker alive")
    assert "(w1: collective failed: Timed out)" in message and "--collective-timeout" in message
