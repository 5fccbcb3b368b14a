"""Per-run metric history: one point per optimizer step, kept in the coordinator's SQLite store.

A step's point gathers what its results already carry: the forward_backward calls since the previous step
(summed `loss:sum`, tokens, their other metrics) and the optim_step's (learning rate, gradient norm, step).
The history survives a restart with the store; it is bounded by thinning, not truncation: once a run has
`max_points` points, every second point of its older half is dropped, so a long run keeps its whole shape at
a coarser grain where it is old.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from bios import messages as m
from bios import types as t
from bios.exceptions import RequestFailedError
from bios.ids import target_of

from .disk import GuardedConnection, is_disk_full
from .metrics import tokens_of

log = logging.getLogger(__name__)

MAX_POINTS_PER_RUN = 100_000

SCHEMA = """
CREATE TABLE IF NOT EXISTS run_metrics (
    run_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    cycle_id INTEGER NOT NULL,
    time REAL NOT NULL,
    loss REAL,
    tokens INTEGER NOT NULL,
    total_tokens INTEGER NOT NULL,
    grad_norm REAL,
    learning_rate REAL,
    metrics TEXT NOT NULL,
    PRIMARY KEY (run_id, step)
);
"""


class RunHistory:
    """The `run_metrics` table: append a step, read a run's points (optionally thinned), summarise it."""

    def __init__(self, db: GuardedConnection, max_points: int = MAX_POINTS_PER_RUN) -> None:
        self.db = db
        self.max_points = max_points
        self._counts: dict[str, int] = {}  # points per run, counted once then kept up to date
        self.db.executescript(SCHEMA)

    def add(self, run_id: str, point: m.MetricPoint) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO run_metrics VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (run_id, point.step, point.cycle_id, point.time, point.loss, point.tokens, point.total_tokens,
             point.grad_norm, point.learning_rate, json.dumps(point.metrics)),
        )
        self._counts[run_id] = self.count(run_id) if run_id not in self._counts else self._counts[run_id] + 1
        if self._counts[run_id] > self.max_points:
            self._thin(run_id)

    def count(self, run_id: str) -> int:
        return int(self.db.execute("SELECT COUNT(*) FROM run_metrics WHERE run_id = ?", (run_id,)).fetchone()[0])

    def _thin(self, run_id: str) -> None:
        """Drop every second point of the older half (never the first point, never the newer half)."""
        steps = [r[0] for r in self.db.execute("SELECT step FROM run_metrics WHERE run_id = ? ORDER BY step",
                                               (run_id,)).fetchall()]
        doomed = steps[1: len(steps) // 2: 2]
        self.db.executemany("DELETE FROM run_metrics WHERE run_id = ? AND step = ?", [(run_id, s) for s in doomed])
        self._counts[run_id] = len(steps) - len(doomed)

    def points(self, run_id: str, max_points: int = 0) -> list[m.MetricPoint]:
        """Oldest first; `max_points` > 0 keeps that many, evenly spread, always the newest."""
        rows = self.db.execute(f"SELECT {_COLUMNS} FROM run_metrics WHERE run_id = ? ORDER BY step",
                               (run_id,)).fetchall()
        if 0 < max_points < len(rows):
            stride = len(rows) / max_points
            rows = [rows[len(rows) - 1 - int(i * stride)] for i in reversed(range(max_points))]
        return [_point(r) for r in rows]

    def last(self, run_id: str) -> m.MetricPoint | None:
        row = self.db.execute(f"SELECT {_COLUMNS} FROM run_metrics WHERE run_id = ? ORDER BY step DESC LIMIT 1",
                              (run_id,)).fetchone()
        return None if row is None else _point(row)


_COLUMNS = "step, cycle_id, time, loss, tokens, total_tokens, grad_norm, learning_rate, metrics"


def _point(row: tuple[Any, ...]) -> m.MetricPoint:
    return m.MetricPoint(int(row[0]), int(row[1]), float(row[2]), row[3], int(row[4]), int(row[5]), row[6], row[7],
                         json.loads(row[8]))


@dataclass
class _Pending:
    """What a run's forward_backward calls reported since its last optimizer step."""

    loss: float | None = None
    tokens: int = 0
    calls: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


class StepRecorder:
    """Turns finished requests into history points: forward_backward results wait here for their step.

    What waits is in memory: a coordinator that restarts between a step's forward_backward and its optim_step
    records that step without the forward_backward's loss and tokens."""

    def __init__(self, history: RunHistory) -> None:
        self.history = history
        self.pending: dict[str, _Pending] = {}
        self._last: dict[str, m.MetricPoint | None] = {}

    def record(self, request_id: str, op: m.Request | None, result: Any, error: Any, cycle_id: int) -> None:
        """Note a finished request; a full disk costs the point (logged), never the request's answer."""
        if error is not None:
            return
        run_id = target_of(request_id)
        if isinstance(op, m.ForwardBackward) and not op.forward_only and isinstance(result, t.ForwardBackwardOutput):
            self._accumulate(self.pending.setdefault(run_id, _Pending()), result.metrics, tokens_of(op, result))
        elif isinstance(op, m.OptimStep) and isinstance(result, t.OptimStepResponse):
            try:
                self._step(run_id, result, cycle_id)
            except RequestFailedError as exc:
                if not is_disk_full(exc):
                    raise
                log.warning("step of %s not recorded in the run history: %s", run_id, exc.message)

    @staticmethod
    def _accumulate(pending: _Pending, metrics: dict[str, float], tokens: int) -> None:
        pending.calls += 1
        pending.tokens += tokens
        for key, value in metrics.items():
            old = pending.metrics.get(key)
            reduction = key.rpartition(":")[2]
            if old is None or reduction not in ("sum", "max", "min", "mean"):
                pending.metrics[key] = value
            elif reduction == "sum":
                pending.metrics[key] = old + value
            elif reduction == "max":
                pending.metrics[key] = max(old, value)
            elif reduction == "min":
                pending.metrics[key] = min(old, value)
            else:
                pending.metrics[key] = old + (value - old) / pending.calls
        pending.loss = pending.metrics.get("loss:sum")

    def _step(self, run_id: str, result: t.OptimStepResponse, cycle_id: int) -> None:
        pending = self.pending.pop(run_id, _Pending())
        if run_id not in self._last:
            self._last[run_id] = self.history.last(run_id)
        last = self._last[run_id]
        opt = result.metrics or {}
        step = int(opt.get("step:max", (last.step if last else 0) + 1))
        fwd_norm = pending.metrics.get("grad_norm:max")
        point = m.MetricPoint(
            step=step,
            cycle_id=cycle_id,
            time=time.time(),
            loss=pending.loss,
            tokens=pending.tokens,
            total_tokens=(last.total_tokens if last else 0) + pending.tokens,
            grad_norm=result.grad_norm if result.grad_norm is not None else fwd_norm,
            learning_rate=result.learning_rate,
            metrics={**pending.metrics, **opt},
        )
        self.history.add(run_id, point)
        self._last[run_id] = point
