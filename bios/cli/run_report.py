"""Runs as text for a terminal: the `bios runs list` table and the `bios runs show` summary with a sparkline."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from bios import messages as m

BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float], width: int = 60) -> str:
    """`values` as one line of block characters, `width` wide at most (each cell the mean of its values)."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return ""
    cells = min(width, len(finite))
    means = []
    for i in range(cells):
        chunk = finite[i * len(finite) // cells: (i + 1) * len(finite) // cells]
        means.append(sum(chunk) / len(chunk))
    low, high = min(means), max(means)
    span = high - low
    return "".join(BARS[0 if span == 0 else min(len(BARS) - 1, int((v - low) / span * len(BARS)))] for v in means)


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def runs_table(summaries: m.RunSummaries) -> list[str]:
    lines = [f"{'run':<36} {'status':<8} {'steps':>6} {'last loss':>10} {'tokens':>10}  last checkpoint"]
    for run in summaries.runs:
        lines.append(f"{run.training_run_id:<36} {run.status:<8} {run.steps:>6} {_loss(run.last_loss):>10} "
                     f"{run.tokens:>10}  {run.last_checkpoint or '-'}")
    lines.append(f"({len(summaries.runs)} of {summaries.total_count})")
    return lines


def run_summary(history: m.TrainingRunMetrics, width: int = 60) -> list[str]:
    run, points = history.summary, history.points
    lines = [
        f"run         {run.training_run_id}",
        f"base model  {run.base_model}",
        f"status      {run.status}",
        f"created     {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(run.created))}",
        f"steps       {run.steps}",
        f"tokens      {run.tokens}",
        f"last loss   {_loss(run.last_loss)}",
        f"checkpoint  {run.last_checkpoint or '-'}",
    ]
    losses = [p.loss for p in points if p.loss is not None]
    if losses:
        lines.append(f"loss        {sparkline(losses, width)}  {_loss(losses[0])} -> {_loss(losses[-1])} "
                     f"(min {_loss(min(losses))}, {len(losses)} points)")
    last = points[-1] if points else None
    if last is not None:
        lines.append(f"last step   {last.step} in cycle {last.cycle_id}: lr {last.learning_rate or '-'}, "
                     f"grad norm {_loss(last.grad_norm)}, {last.tokens} tokens")
    return lines
