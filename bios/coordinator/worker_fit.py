"""Which live workers serve the pool: those whose memory budget holds its base models.

One small worker must not drag every plan down to its budget (forcing tensor parallelism or activation
checkpointing on a pool of large ones, or refusing the run): a worker that cannot hold what the others can is
*parked* — it stays registered and heartbeating, outside the data-parallel group, and gets no items — and
serves again as soon as the pool's plans fit it. Pure: the planner asks it when it sizes a plan and again for
every generation the cycle runner forms.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from bios.models.memory_plan import GiB

# Why a worker with this many bytes cannot hold the pool's models (None: it can).
Problem = Callable[[int], str | None]


@dataclass(frozen=True)
class WorkerFit:
    serving: tuple[str, ...]  # worker ids whose budget holds the pool's models (empty: none does)
    parked: dict[str, str]  # worker id -> why it waits


def fit_workers(budgets: Mapping[str, int], problem: Problem) -> WorkerFit:
    """Split `budgets` (worker id -> bytes) into the workers `problem` finds no fault with and the parked rest.

    Callers decide what an empty `serving` means: a planner falls back to every worker (and tensor
    parallelism), a generation waits for a worker with room.
    """
    why = {worker: problem(budget) for worker, budget in budgets.items()}
    serving = tuple(worker for worker, reason in why.items() if reason is None)
    served = f"{len(serving)} worker(s) with room serve it" if serving else "no worker with room is connected"
    parked = {worker: f"worker {worker} ({budgets[worker] / GiB:.2f} GiB) waits: {reason}; {served}"
              for worker, reason in why.items() if reason is not None}
    return WorkerFit(serving, parked)
