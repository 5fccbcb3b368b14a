"""Backpressure: caps on what one key, and all keys together, may have queued on a coordinator.

Every accepted request holds a ticket until its result is stored: a count, its encoded size and whether it
samples. A request over a cap is refused with a retryable `RateLimitError` *before* anything about its run
changes, so the client resends the very same request (same `seq_id`) after `retry_after`. A run's next
request (the one its queue waits for) is never refused: later requests of the run, accepted while it was being
resent, would otherwise hold the places it needs and stall the run for good. A request larger than any queue
could ever take (too many tokens) is a `BadRequestError` instead: retrying cannot help. Together with the
transport's message size limit this bounds the coordinator's memory.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from dataclasses import dataclass

from bios.exceptions import BadRequestError, RateLimitError

MIB = 1024 * 1024


@dataclass(frozen=True)
class Quotas:
    max_queued_per_key: int = 256  # accepted, unfinished requests of one key
    max_queued: int = 4096  # ... of all keys together
    max_queued_bytes_per_key: int = 512 * MIB  # their encoded size
    max_queued_bytes: int = 2048 * MIB
    max_sampling_per_key: int = 64  # unfinished sample requests of one key
    max_sampling: int = 512
    max_tokens_per_request: int = 262_144  # forward tokens of a batch; num_samples x (prompt + max_tokens)
    max_message_bytes: int = 64 * MIB  # one client message (the worker socket keeps the transport's limit)
    retry_after_s: float = 1.0

    @classmethod
    def from_env(cls) -> Quotas:
        """Defaults, overridden by `BIOS_QUOTA_<FIELD>` variables (e.g. `BIOS_QUOTA_MAX_QUEUED_PER_KEY=64`)."""
        values: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            raw = os.environ.get(f"BIOS_QUOTA_{f.name.upper()}")
            if raw is not None:
                kind = float if f.name == "retry_after_s" else int
                try:
                    values[f.name] = kind(raw)
                except ValueError:
                    raise ValueError(f"BIOS_QUOTA_{f.name.upper()} must be a number, got {raw!r}") from None
        return cls(**values)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Ticket:
    owner: str
    nbytes: int
    sampling: bool


class QuotaLedger:
    """Who holds which tickets. Used from the coordinator's event loop only, so check-then-record is atomic
    as long as no await sits between them."""

    def __init__(self, quotas: Quotas) -> None:
        self.quotas = quotas
        self.tickets: dict[str, Ticket] = {}
        self.queued: Counter[str] = Counter()
        self.queued_bytes: Counter[str] = Counter()
        self.sampling: Counter[str] = Counter()
        self.total_bytes = 0
        self.total_sampling = 0
        self.arriving: Counter[str] = Counter()
        self.rejected = 0

    def check(self, owner: str, *, nbytes: int, sampling: bool) -> None:
        """RateLimitError if accepting one more such request would pass a cap."""
        q = self.quotas
        if self.queued[owner] >= q.max_queued_per_key:
            self._refuse(f"this key has {self.queued[owner]} unfinished requests, the most one key may queue")
        if len(self.tickets) >= q.max_queued:
            self._refuse(f"the cluster has {len(self.tickets)} unfinished requests, the most it queues")
        if self.queued_bytes[owner] + nbytes > q.max_queued_bytes_per_key:
            self._refuse(f"this key's queued requests hold {self.queued_bytes[owner] // MIB} MiB; one more of "
                         f"{nbytes // MIB} MiB would pass the {q.max_queued_bytes_per_key // MIB} MiB cap")
        if self.total_bytes + nbytes > q.max_queued_bytes:
            self._refuse(f"the cluster's queued requests hold {self.total_bytes // MIB} MiB, near its "
                         f"{q.max_queued_bytes // MIB} MiB cap")
        if sampling and self.sampling[owner] >= q.max_sampling_per_key:
            self._refuse(f"this key has {self.sampling[owner]} sample requests in progress, the most one key may")
        if sampling and self.total_sampling >= q.max_sampling:
            self._refuse(f"the cluster has {self.total_sampling} sample requests in progress, the most it runs")

    def record(self, request_id: str, owner: str, *, nbytes: int, sampling: bool) -> None:
        ticket = Ticket(owner, nbytes, sampling)
        self.tickets[request_id] = ticket
        self.queued[owner] += 1
        self.queued_bytes[owner] += nbytes
        self.total_bytes += nbytes
        if sampling:
            self.sampling[owner] += 1
            self.total_sampling += 1

    def release(self, request_id: str) -> None:
        ticket = self.tickets.pop(request_id, None)
        if ticket is None:
            return
        owner = ticket.owner
        _decrement(self.queued, owner)
        _decrement(self.queued_bytes, owner, ticket.nbytes)
        self.total_bytes -= ticket.nbytes
        if ticket.sampling:
            _decrement(self.sampling, owner)
            self.total_sampling -= 1

    def check_tokens(self, tokens: int, field: str) -> None:
        limit = self.quotas.max_tokens_per_request
        if tokens > limit:
            raise BadRequestError(f"this request has {tokens} tokens, more than the {limit} one request may carry; "
                                  "split it into smaller requests", field=field)

    # ------------------------------------------------------------------------------------ before the scheduler

    def arrive(self, owner: str) -> None:
        """A request of `owner` enters the scheduler's mailbox; a key may not have more there than it may queue."""
        if self.arriving[owner] >= self.quotas.max_queued_per_key:
            self._refuse(f"this key has {self.arriving[owner]} requests waiting to be accepted")
        self.arriving[owner] += 1

    def arrived(self, owner: str) -> None:
        _decrement(self.arriving, owner)

    def _refuse(self, why: str) -> None:
        self.rejected += 1
        raise RateLimitError(f"{why}; retry in {self.quotas.retry_after_s:g}s (the SDK does so by itself)",
                             retry_after=self.quotas.retry_after_s)


def _decrement(counter: Counter[str], key: str, amount: int = 1) -> None:
    """Drop keys that reach zero, so the ledger's size follows the work in flight, not every key ever seen."""
    left = counter[key] - amount
    if left > 0:
        counter[key] = left
    else:
        counter.pop(key, None)
