"""A run's request timelines as Chrome trace JSON (the Trace Event Format), which Perfetto and chrome://tracing
open: one row for waiting (accepted until its cycle took it), one for running (until it finished)."""

from __future__ import annotations

from typing import Any

from bios import messages as m

WAITING_TID, RUNNING_TID = 1, 2


def chrome_trace(trace: m.RunTrace) -> dict[str, Any]:
    def us(seconds: float) -> float:
        return round(seconds * 1e6, 1)

    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": f"run {trace.training_run_id}"}},
        {"ph": "M", "pid": 1, "tid": WAITING_TID, "name": "thread_name", "args": {"name": "waiting for a cycle"}},
        {"ph": "M", "pid": 1, "tid": RUNNING_TID, "name": "thread_name", "args": {"name": "in a cycle"}},
    ]
    for req in trace.requests:
        args = {"request_id": req.request_id, "seq_id": req.seq_id, "status": req.status, "cycle_id": req.cycle_id}
        name = f"{req.op} #{req.seq_id}"
        taken = req.started if req.started is not None else req.finished
        if taken is not None:
            events.append({"ph": "X", "pid": 1, "tid": WAITING_TID, "name": name, "cat": "waiting",
                           "ts": us(req.accepted), "dur": us(max(taken - req.accepted, 0.0)), "args": args})
        if req.started is not None and req.finished is not None:
            events.append({"ph": "X", "pid": 1, "tid": RUNNING_TID, "name": name, "cat": "running",
                           "ts": us(req.started), "dur": us(max(req.finished - req.started, 0.0)), "args": args})
        if taken is None:  # still queued, or refused at acceptance
            events.append({"ph": "i", "s": "t", "pid": 1, "tid": WAITING_TID, "name": f"{name} ({req.status})",
                           "ts": us(req.accepted), "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
