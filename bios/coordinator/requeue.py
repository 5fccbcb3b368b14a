"""What an ended cycle's work becomes: a committed cycle's runs move on (and its tokens count toward the
placement's demand); an aborted one's unfinished requests go back to their queues, or are given up with why
(`bios.coordinator.retries`). A verdict the scheduler acts on; nothing here answers a client."""

from __future__ import annotations

from dataclasses import dataclass, field

from bios import messages as m

from .exchange import CycleOutcome
from .metrics import tokens_of
from .retries import killed_twice, stalled_once, stalled_twice
from .runs import Queued, Run


@dataclass
class CycleWork:
    """What the scheduler keeps of one running cycle: its items' ops and the runs it took work from."""

    ops: dict[str, m.Request]  # request id -> op (of a part of a request cut over cycles: its rows only)
    runs: set[str]  # model ids
    whole: dict[str, m.Request] = field(default_factory=dict)  # request id -> the whole op, of each cut part


@dataclass
class Requeued:
    failed: list[tuple[Queued, str]] = field(default_factory=list)  # given up: each fails with why
    notices: list[tuple[Queued, str]] = field(default_factory=list)  # run again after a stall: why they wait
    samples: list[Queued] = field(default_factory=list)  # unfinished samples, back to the front of their queue
    ran: dict[str, int] = field(default_factory=dict)  # tokens a committed cycle ran, per base model


def requeue(work: CycleWork, outcome: CycleOutcome, runs: dict[str, Run], budgets: list[int]) -> Requeued:
    """Move the cycle's runs on (committed) or put back what it did not finish (aborted)."""
    verdict = Requeued()
    if not outcome.aborted:
        results = {done.request_id: done.result for done in outcome.results}
        for request_id, op in work.ops.items():
            run = runs.get(op.target)
            base_model = op.base_model if isinstance(op, m.Sample) else run.base_model if run is not None else None
            if base_model is not None:
                tokens = tokens_of(op, results.get(request_id))
                verdict.ran[base_model] = verdict.ran.get(base_model, 0) + tokens
    finished = outcome.finished
    for run in (runs[model_id] for model_id in work.runs if model_id in runs):
        if not outcome.aborted:
            run.cycle_committed(finished)
            continue
        returned = run.cycle_aborted(set(finished), worker_died=outcome.worker_died, stalled=outcome.stalled)
        for queued in returned.given_up:
            verdict.failed.append((queued, killed_twice(queued, budgets) if queued.deaths >= queued.stalls
                                   else stalled_twice(queued, outcome.why)))
        if outcome.stalled:
            verdict.notices.extend((queued, stalled_once(outcome.why)) for queued in returned.retried)
    if outcome.aborted:
        verdict.samples = [Queued(request_id, op) for request_id, op in work.ops.items()
                           if isinstance(op, m.Sample) and request_id not in finished]
    return verdict
