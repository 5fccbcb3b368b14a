"""Result routing: every answer is written to the request log before it is pushed to the peers waiting for it.

So a resubmitted (target, seq_id) is answered from the log, and a peer that asks again while the request runs
is added to its waiters rather than running it twice. A log the full disk refuses does not stop the answer.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from bios import ids
from bios import messages as m
from bios.exceptions import ERROR_TYPES, BadRequestError, NotFoundError, RemoteError, RequestFailedError
from bios.security.limits import QuotaLedger
from bios.transport.codec import Codec, Envelope
from bios.transport.sockets import next_message_id

from .admission import Refused
from .disk import is_disk_full
from .history import RunHistory, StepRecorder
from .metrics import CoordinatorMetrics
from .store import Store, StoredRequest
from .trace import RequestTimeline
from .usage import Usage

log = logging.getLogger(__name__)

Push = Callable[[bytes, list[Any]], Awaitable[None]]


class ResultRouter:
    def __init__(self, store: Store, codec: Codec, push: Push, ledger: QuotaLedger,
                 metrics: CoordinatorMetrics) -> None:
        self.store = store
        self.codec = codec
        self.push = push
        self.ledger = ledger
        self.metrics = metrics
        self.steps = StepRecorder(RunHistory(store.db))
        self.timeline = RequestTimeline(store.db)
        self.usage = Usage(store)
        self.waiters: dict[str, set[bytes]] = {}

    def wait(self, request_id: str, peer: bytes) -> None:
        self.waiters.setdefault(request_id, set()).add(peer)

    async def repeat(self, peer: bytes, stored: StoredRequest) -> m.Accepted:
        """A resubmission: the stored answer (or the stored refusal, raised again), or a wait for the result."""
        if stored.status == "rejected":
            error = self.codec.decode(stored.result).body.error
            raise ERROR_TYPES.get(error.type, BadRequestError)(error.message, field=error.field,
                                                               request_id=stored.request_id)
        if stored.result is not None:
            await self.push(peer, stored.result)
        else:
            self.wait(stored.request_id, peer)
        return m.Accepted(stored.request_id)

    async def watch(self, peer: bytes, owner: str, request_id: str) -> m.Ack:
        """Push `peer` the logged answer of `owner`'s request now, or when it comes; NotFoundError if `owner` has
        no such request."""
        target = ids.target_of(request_id)
        run = self.store.get_run(target)
        sampler = self.store.get_sampling_session(target)
        owner_of = run.owner if run is not None else sampler[0] if sampler is not None else None
        stored = self.store.get_request(request_id)
        if stored is None or owner_of != owner:
            raise NotFoundError(f"no request {request_id!r}", field="request_id")
        await self.repeat(peer, stored)
        return m.Ack()

    def refuse(self, refused: Refused) -> None:
        """Record a refusal, so a resubmission of the same seq_id gets the same error."""
        exc = refused.error
        exc.request_id = refused.request_id
        frames = self.encode(m.RequestDone(refused.request_id, error=RemoteError.from_exception(exc)))
        try:
            self.store.add_rejected(refused.request_id, refused.target, refused.seq_id, type(refused.op).__name__,
                                    frames)
        except RequestFailedError as full:  # the refusal stands; a resubmission only gets a different error
            if not is_disk_full(full):
                raise
            log.warning("refusal of %s not recorded: %s", refused.request_id, full.message)
        self.metrics.request_rejected(refused.request_id, refused.op, exc.message)

    async def deliver(self, request_id: str, op: m.Request | None, result: Any, error: RemoteError | None,
                      cycle_id: int = 0) -> None:
        """Log the outcome of an accepted request, then answer everyone waiting for it."""
        self.metrics.request_finished(request_id, op, result, error)
        frames = self.encode(m.RequestDone(request_id, result, error, cycle_id))
        try:
            self.store.finish_request(request_id, "failed" if error else "done", frames)
        except RequestFailedError as full:  # it ran: its waiters still hear how it went
            if not is_disk_full(full):
                raise
            log.error("the outcome of %s is not in the request log (a coordinator restarted before space is freed "
                      "would run it again): %s", request_id, full.message)
        self.steps.record(request_id, op, result, error, cycle_id)
        if error is None:
            self.usage.record(op, result)
        self.timeline.finished(request_id, cycle_id)
        self.ledger.release(request_id)
        for peer in self.waiters.pop(request_id, ()):
            await self.push(peer, frames)

    async def withdraw(self, request_id: str, op: m.Request | None, error: RemoteError) -> None:
        """Take back an accepted request that never ran: its waiters get `error`, the log forgets it (a resend
        runs it afresh)."""
        self.metrics.request_rejected(request_id, op, error.message)
        self.timeline.forget(request_id)
        self.store.forget_request(request_id)
        self.ledger.release(request_id)
        frames = self.encode(m.RequestDone(request_id, error=error))
        for peer in self.waiters.pop(request_id, ()):
            await self.push(peer, frames)

    async def notify(self, request_id: str, message: str) -> None:
        """Tell the peers waiting for a request why it waits (a worker died, no worker is connected...)."""
        frames = self.encode(m.Notice(request_id, message))
        for peer in self.waiters.get(request_id, ()):
            await self.push(peer, frames)

    async def progress(self, progress: m.SampleProgress) -> None:
        """A streaming sample's tokens so far, to the peers waiting for it (nothing is logged: the result is)."""
        peers = list(self.waiters.get(progress.request_id, ()))
        if peers:
            frames = self.encode(progress)
            for peer in peers:
                await self.push(peer, frames)

    def encode(self, done: m.RequestDone | m.Notice | m.SampleProgress) -> list[bytes]:
        return [bytes(f) for f in self.codec.encode(Envelope(next_message_id(), done))]
