"""How much of a big forward request one cycle takes while other runs share its group: shorter cycles for big
batches (DESIGN §5b). A group's cycle ends when its biggest batch does, so a run of one-row batches beside a run
of 64-row batches steps once per big step.

A request at least CUT_RATIO times bigger (in tokens) than the batches of every other active run of its group is
cut into cycles of whole rows, at least one row per replica. The workers keep its gradient pending until its last
part and answer it whole (`bios.messages.WorkItem.part`), so it trains exactly as uncut (sums in another order
aside); the small runs step once per part. Each added cycle costs about a cycle's fixed cost (the group's
shortest recent cycle), so a request is cut only as far as those costs stay within CUT_COST of the cycle that ran
it whole: on a GPU, where a big batch's pass takes seconds, into MAX_PARTS; on a CPU with a tiny model, where a
one-row cycle costs a seventh of a 64-row one, not at all. On a grid clock (`--cycle-s`) every cycle holds the
group until the next tick (`CycleClock.held_for`), so a part costs a whole tick: a request is cut there only
when it takes 20 ticks or more.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable

from bios import messages as m

from .metrics import tokens_of
from .runs import Run

CUT_RATIO = 8  # cut only a request this many times bigger than the other active runs' batches
MAX_PARTS = 4  # into at most this many cycles
# The added cycles' fixed cost may slow the big run's step by at most this share (`BIOS_CUT_COST`: an operator
# trading more of big runs' throughput for small runs' latency sets it higher)
CUT_COST = float(os.environ.get("BIOS_CUT_COST", "0.05"))
ACTIVE_S = 5.0  # a run whose work a cycle took this recently is active (its client is between two calls)
WINDOW = 64  # committed training cycles a group's shortest is taken over
REPLY_WAIT_S = 0.02  # how long a cut request's next part waits for the small runs' next calls


class CycleCosts:
    """A group's recent committed training cycles: the shortest (about a cycle's fixed cost), and per run the
    last one that ran its forward request whole."""

    def __init__(self) -> None:
        self.recent: deque[float] = deque(maxlen=WINDOW)
        self.whole_s: dict[str, float] = {}

    def ran(self, seconds: float, whole: Iterable[str]) -> None:
        """A cycle of `seconds` ran the forward requests of the runs `whole` uncut."""
        self.recent.append(seconds)
        for model_id in whole:
            self.whole_s[model_id] = seconds

    def parts(self, model_id: str) -> int:
        """Into how many cycles a forward request of `model_id` may be cut (1: not measured yet)."""
        whole = self.whole_s.get(model_id)
        if whole is None or not self.recent or min(self.recent) <= 0:
            return 1
        return max(1, min(MAX_PARTS, 1 + int(CUT_COST * whole / min(self.recent))))


def rows_per_cycle(rows: int, tokens: int, others: list[int], replicas: int, parts: int) -> int | None:
    """The most rows one cycle takes of a forward request of `rows` rows and `tokens` tokens, cut into at most
    `parts` cycles, beside other active runs whose batches have `others` tokens; None: all of them."""
    if parts < 2 or not others or tokens < CUT_RATIO * max(max(others), 1):
        return None
    most = max(replicas, -(-rows // parts))
    return most if most < rows else None


def most_rows(run: Run, group_runs: list[Run], replicas: int, now: float, costs: CycleCosts) -> int | None:
    """`rows_per_cycle` of `run`'s next request, beside the other runs of its group active since ACTIVE_S ago;
    None when it is not a forward request or runs whole."""
    head = run.head()
    if head is None or head.rejected or not isinstance(head.op, m.FORWARD_TYPES):
        return None
    others = [size for other in group_runs
              if other is not run and other.active(now - ACTIVE_S) and (size := other.batch_size())]
    return rows_per_cycle(len(head.op.data), tokens_of(head.op, None), others, replicas, costs.parts(run.model_id))


def awaited_part(group_runs: list[Run], now: float) -> tuple[str, int] | None:
    """The next part of a request cut over cycles (its run, the rows done), when another active run of the group
    has nothing queued: its client, just answered, is sending its next call, which that part's cycle should take
    (with back-to-back cycles it would start first, and the small run would step every other part). None when
    nothing is worth waiting for."""
    cut = next((run for run in group_runs if run.ready() and run.head().done_rows), None)
    if cut is None or not any(other is not cut and not other.ready() and other.active(now - ACTIVE_S)
                              for other in group_runs):
        return None
    return cut.model_id, cut.head().done_rows


class CycleShare:
    """What the rules above remember, per group: its cycles' costs, and the part it last waited before (a part
    waits once). The scheduler asks it at each tick and tells it each committed cycle."""

    def __init__(self) -> None:
        self.costs: dict[tuple[str, ...], CycleCosts] = {}  # by the group's base models
        self.awaited: dict[str, tuple[str, int]] = {}  # group id -> (run, rows done) of the part waited before

    def most_rows(self, run: Run, group_runs: list[Run], replicas: int, models: tuple[str, ...],
                  now: float) -> int | None:
        return most_rows(run, group_runs, replicas, now, self.costs.setdefault(models, CycleCosts()))

    def wait_s(self, group_id: str, group_runs: list[Run], now: float) -> float:
        """How long the group's next cycle waits for the small runs' next calls (`awaited_part`); 0: none."""
        part = awaited_part(group_runs, now)
        if part is None or self.awaited.get(group_id) == part:
            return 0.0
        self.awaited[group_id] = part
        return REPLY_WAIT_S

    def ran(self, models: tuple[str, ...], seconds: float, ops: dict[str, m.Request],
            parts: Iterable[str]) -> None:
        """A committed cycle of a group of `models` held it `seconds`, running `ops` (request id -> op; `parts`:
        the ids of parts of requests cut over cycles)."""
        forward = {request_id: op for request_id, op in ops.items() if isinstance(op, m.FORWARD_TYPES)}
        if forward:
            cut = set(parts)
            self.costs.setdefault(models, CycleCosts()).ran(
                seconds, {op.target for request_id, op in forward.items() if request_id not in cut})
