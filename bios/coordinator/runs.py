"""Per-run request queues: ordering by `seq_id` and selection of one cycle's work.

A run executes its requests strictly in `seq_id` order. Requests may arrive out of order (Tinker sends a call's
chunks concurrently); a gap holds everything behind it. A rejected request still occupies its `seq_id` so the
queue moves past it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from bios import messages as m
from bios import types as t

from .metrics import tokens_of


@dataclass
class Queued:
    request_id: str
    op: m.Request | None  # None: a refusal restored from the request log (it only holds its seq_id)
    rejected: bool = False
    queued_at: float = field(default_factory=time.monotonic)
    deaths: int = 0  # cycles that aborted because a worker died while running this request
    stalls: int = 0  # cycles that aborted with every worker alive (a collective timed out) while running it
    # A forward request cut over cycles (`bios.coordinator.cycle_share`): rows its committed parts ran (their
    # gradient pending on the workers), and rows the running cycle takes (0: it runs whole)
    done_rows: int = 0
    part_rows: int = 0

    def work_item(self) -> m.WorkItem:
        """What a cycle runs of this request: all of it, or the rows of its part."""
        if not self.part_rows:
            return m.WorkItem(self.request_id, self.op)
        rows = self.op.data[self.done_rows:self.done_rows + self.part_rows]
        return m.WorkItem(self.request_id, dataclasses.replace(self.op, data=rows), (self.done_rows, len(self.op.data)))

    def restart(self) -> None:
        """Its parts so far are gone with the workers' pending gradients (a cycle aborted, a generation formed)."""
        self.done_rows = self.part_rows = 0


@dataclass(frozen=True)
class Returned:
    """What `Run.cycle_aborted` did with an aborted cycle's unfinished requests."""

    retried: list[Queued]  # back in the queue, to run again
    given_up: list[Queued]  # their seq_ids used up: the caller fails them


def stored_config(lora: t.LoraConfig, optimizer: t.OptimizerName) -> dict[str, object]:
    """What the store keeps of a run's training configuration (its `lora_config` column): LoRA shape and
    optimizer."""
    return {**dataclasses.asdict(lora), "optimizer": optimizer}


def from_stored_config(config: dict[str, object]) -> tuple[t.LoraConfig, t.OptimizerName]:
    """`stored_config` read back; runs stored before optimizers were chosen trained with AdamW."""
    fields = dict(config)
    optimizer = fields.pop("optimizer", "adamw")
    return t.LoraConfig(**fields), optimizer  # type: ignore[arg-type, return-value]


@dataclass
class Run:
    model_id: str
    session_id: str
    owner: str
    base_model: str
    lora: t.LoraConfig
    status: str = "creating"  # creating | ready | lost
    info: t.BaseModelInfo | None = None
    lost_reason: str = ""
    next_seq: int = 0
    queue: dict[int, Queued] = field(default_factory=dict)
    in_flight: list[tuple[int, Queued]] = field(default_factory=list)
    progressed_at: float = field(default_factory=time.monotonic)  # when its next request last came or ran
    optimizer: t.OptimizerName = "adamw"  # chosen at creation
    lora_targets: list[t.LoraTargetGroup] | None = None  # what its adapter trains, as the worker created it
    held: str | None = None  # why its next request waits although it could run (its group shrank under it)
    batch_tokens: int = 0  # tokens of the last forward request a cycle took: how big its batches are
    taken_at: float = float("-inf")  # when a cycle last took its work

    def describe(self, memory_plan: str | None, longest_row: int | None = None,
                 longest_forward_row: int | None = None) -> t.GetInfoResponse:
        """What `get_info()` reports: the run's model, LoRA shape and seed, and how the workers hold its base
        (its plan, and the longest row they train)."""
        info = self.info
        return t.GetInfoResponse(
            model_id=self.model_id,
            model_data=t.ModelData(arch=info.arch if info else None, model_name=self.base_model,
                                   tokenizer_id=info.local_dir if info else None),
            is_lora=True,
            lora_rank=self.lora.rank,
            model_name=self.base_model,
            memory_plan=memory_plan,
            base_dtype=info.base_dtype if info else None,
            lora_seed=self.lora.seed,
            optimizer=self.optimizer,
            lora_targets=self.lora_targets,
            longest_row=longest_row,
            longest_forward_row=longest_forward_row,
        )

    def enqueue(self, seq_id: int, item: Queued) -> None:
        self.queue[seq_id] = item
        if seq_id == self.next_seq:
            self.progressed_at = time.monotonic()

    def expire_gap(self, gap_s: float) -> list[tuple[Queued, str]]:
        """Requests that have waited `gap_s` behind a seq_id that never came (a client sends a call's chunks
        at once, so one can go missing), taken out of the queue for the caller to withdraw, each with why.
        Nothing when the run is not stuck behind a gap."""
        if self.runnable() or not self.queue or time.monotonic() - self.progressed_at < gap_s:
            return []
        waiting = [seq_id for seq_id in sorted(self.queue) if not self.queue[seq_id].rejected]
        return [(self.queue.pop(seq_id), f"request seq_id {seq_id} of {self.model_id} was not run: seq_id "
                 f"{self.next_seq} never arrived within {gap_s:.0f}s; resend seq_id {self.next_seq} and the "
                 "requests after it") for seq_id in waiting]

    def runnable(self) -> bool:
        return self.next_seq in self.queue

    def ready(self) -> bool:
        """Runnable and not held: a cycle would take its next request."""
        return self.runnable() and self.held is None

    def runs_alone(self) -> bool:
        """Whether this run's next cycle stalled before: it runs in a cycle of its own, so that a stall again
        is its own doing and fails only its requests."""
        head = self.queue.get(self.next_seq)
        return head is not None and head.stalls > 0

    def head(self) -> Queued | None:
        """The request it runs next, if it has come."""
        return self.queue.get(self.next_seq)

    def batch_size(self) -> int:
        """Tokens of its batches: its next forward request's, else its last one's."""
        head = self.head()
        waiting = tokens_of(head.op, None) if head is not None and not head.rejected else 0
        return waiting or self.batch_tokens

    def active(self, since: float) -> bool:
        """Whether it has work now, or a cycle took its work after `since` (its client is between two calls)."""
        return self.ready() or self.taken_at > since

    def take_cycle(self, hold: Callable[[Queued], str | None] = lambda queued: None,
                   most_rows: int | None = None) -> list[Queued]:
        """This cycle's share: forward work in order, up to and including the first other op; it stops before a
        request `hold` says must wait (why: kept in `held`, which the scheduler clears when the placement
        changes). A forward request of more than `most_rows` rows runs a part of that many rows, alone, and stays
        at the head of the queue until a cycle takes its last part."""
        taken: list[Queued] = []
        while self.next_seq in self.queue and self.held is None:
            head = self.queue[self.next_seq]
            if not head.rejected and (why := hold(head)) is not None:
                self.held = why
                break
            if not head.rejected and isinstance(head.op, m.FORWARD_TYPES):
                if not head.done_rows:
                    self.batch_tokens = tokens_of(head.op, None)
                left = len(head.op.data) - head.done_rows
                if most_rows is not None and left > most_rows:  # a part that more cycles continue
                    if not taken:
                        head.part_rows = most_rows
                        self.in_flight.append((self.next_seq, head))
                        self.taken_at = time.monotonic()
                        taken.append(head)
                    break
                head.part_rows = left if head.done_rows else 0  # its last part, or all of it
            item = self.queue.pop(self.next_seq)
            self.in_flight.append((self.next_seq, item))
            self.next_seq += 1
            self.progressed_at = self.taken_at = time.monotonic()
            if item.rejected:
                continue
            taken.append(item)
            if not isinstance(item.op, m.FORWARD_TYPES):
                break
        return taken

    def stalled(self, older_than_s: float) -> str | None:
        """Why this run's queue has made no progress for `older_than_s`, if it has not (None otherwise)."""
        # (a request cut over cycles whose parts are running is not waiting)
        waiting = [q for q in self.queue.values() if not q.rejected and not (q.done_rows or q.part_rows)]
        if not waiting:
            return None
        age = time.monotonic() - min(q.queued_at for q in waiting)
        if age < older_than_s:
            return None
        if not self.runnable():
            return (f"{len(waiting)} request(s) of {self.model_id} have waited {age:.0f}s for seq_id {self.next_seq}, "
                    "which never arrived (a client that reserved it and died?)")
        held = f": {self.held}" if self.held else ""
        return f"{len(waiting)} request(s) of {self.model_id} have waited {age:.0f}s to run{held}"

    def ran_elsewhere(self, seq_id: int) -> Queued | None:
        """Take `seq_id` out of the queue: a worker ran and committed it before this coordinator's log recorded
        it (the coordinator restarted). None when it is not queued here, or was refused."""
        queued = self.queue.get(seq_id)
        if queued is None or queued.rejected:
            return None
        del self.queue[seq_id]
        self.next_seq = seq_id + 1
        for passed in [s for s in self.queue if s < self.next_seq]:  # refused ones it passed
            del self.queue[passed]
        return queued

    def cycle_committed(self, finished: frozenset[str] | set[str] = frozenset()) -> None:
        """Its work in a committed cycle is done; a part that more cycles continue moves on (or, if it failed:
        it reported, which such a part only does on failure, the request ends)."""
        for seq_id, item in self.in_flight:
            if self.queue.get(seq_id) is not item:
                continue
            if not self._end_failed_part(seq_id, item, finished):
                item.done_rows += item.part_rows
            item.part_rows = 0
        self.in_flight.clear()

    def _end_failed_part(self, seq_id: int, item: Queued, finished: Collection[str]) -> bool:
        """A part that more cycles would continue reported only if it failed: its request ended with its error
        and leaves the queue; True if so."""
        if item.request_id not in finished or self.queue.get(seq_id) is not item:
            return False
        del self.queue[seq_id]
        self.next_seq = max(self.next_seq, seq_id + 1)
        return True

    def restart_cut(self) -> None:
        """A new generation discarded the workers' pending gradients: a request cut over cycles starts again."""
        head = self.head()
        if head is not None:
            head.restart()

    def cycle_aborted(self, finished: set[str], *, worker_died: bool = False, stalled: bool = False,
                      max_deaths: int = 2) -> Returned:
        """Return an aborted cycle's unfinished items (with the rejected ones between them) to the queue.

        With `worker_died`, each unfinished item counts a death; with `stalled`, a stall (the cycle could not
        complete with every worker alive). One that reaches `max_deaths` of either is given up (its seq_id used
        up) and returned, for the caller to fail: a batch that kills workers is not fed to the next, and a pass
        that cannot complete is not run forever.
        """
        returned = Returned([], [])
        for seq_id, item in self.in_flight:
            item.restart()  # a request cut over cycles: its pending parts are discarded on the workers
            if item.request_id in finished:
                self._end_failed_part(seq_id, item, finished)
                continue
            if (worker_died or stalled) and not item.rejected:
                item.deaths += worker_died
                item.stalls += stalled
                if max(item.deaths, item.stalls) >= max_deaths:
                    returned.given_up.append(item)
                    item = Queued(item.request_id, item.op, rejected=True)
            if not item.rejected:
                returned.retried.append(item)
            self.queue[seq_id] = item
            self.next_seq = min(self.next_seq, seq_id)
        self.in_flight.clear()
        return returned


def queued_tokens(runs: Iterable[Run]) -> dict[str, int]:
    """Tokens waiting in the training queues, per base model (a refused request holds a place, not work)."""
    tokens: dict[str, int] = {}
    for run in runs:
        waiting = sum(tokens_of(q.op, None) for q in run.queue.values() if not q.rejected)
        tokens[run.base_model] = tokens.get(run.base_model, 0) + waiting
    return tokens


def queue_depths(runs: Iterable[Run], samples: Iterable[Queued]) -> dict[str, int]:
    """Waiting requests per base model (training queues and samples)."""
    depths: dict[str, int] = {}
    for run in runs:
        depths[run.base_model] = depths.get(run.base_model, 0) + len(run.queue)
    for queued in samples:
        depths[queued.op.base_model] = depths.get(queued.op.base_model, 0) + 1
    return depths
