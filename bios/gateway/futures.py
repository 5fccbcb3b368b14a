"""The gateway's promises: each accepted request's reply, held until the client fetches it with retrieve_future.

A Tinker client polls `retrieve_future` and re-polls at once when told `try_again`, so a poll waits here (up to
the long-poll limit) for the reply rather than answering immediately. Results arrive from the coordinator as
`RequestDone` pushes; each is rendered once into the bytes the client expects (JSON or protobuf) and kept for
re-polls a while after it was first served.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from bios import messages as m
from bios.exceptions import RemoteError
from bios.cluster_defaults import PROGRESS_EVERY_S

from . import json_wire

log = logging.getLogger(__name__)

JSON = "application/json"
PROTOBUF = "application/x-protobuf"
NOTICE_FRESH_S = 2.5 * PROGRESS_EVERY_S  # a reason the coordinator has not repeated for this long may be stale


@dataclass(frozen=True)
class Reply:
    body: bytes
    content_type: str


def json_reply(value: Any) -> Reply:
    return Reply(json.dumps(value).encode(), JSON)


Render = Callable[[Any], Awaitable[Reply]]


@dataclass
class Promise:
    request_id: str
    owner: str  # only its owner may retrieve it
    render: Render  # turns the request's result into its reply
    created: float = field(default_factory=time.monotonic)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    reply: Reply | None = None
    served_at: float | None = None
    failed: bool = False  # its reply is an error: a resubmission asks the coordinator again (which may run it,
    # if it was withdrawn, or answer the same error from its log)
    notice: str | None = None  # why it waits, as the coordinator last said
    notice_at: float = 0.0


class Promises:
    """Promises by request id. Used only from the coordinator's event loop."""

    def __init__(self, keep_served_s: float, keep_unclaimed_s: float) -> None:
        self.keep_served_s = keep_served_s
        self.keep_unclaimed_s = keep_unclaimed_s
        self._promises: dict[str, Promise] = {}
        self._pending = 0
        self._rendering: set[asyncio.Task[None]] = set()
        self._closed = False
        self.listeners: list[Callable[[Promise], None]] = []  # told of every promise as it settles

    def expect(self, request_id: str, owner: str, render: Render) -> Promise:
        """The promise of `request_id`, created unless it exists (a resubmitted request keeps its promise)."""
        promise = self._promises.get(request_id)
        if promise is None or promise.failed:
            promise = self._promises[request_id] = Promise(request_id, owner, render)
            self._pending += 1
        return promise

    def knows(self, request_id: str) -> bool:
        return request_id in self._promises

    def forget(self, request_id: str) -> None:
        """Drop a promise whose request was refused at submission (the client got the error, not a promise)."""
        promise = self._promises.get(request_id)
        if promise is not None and promise.reply is None:
            del self._promises[request_id]
            self._pending -= 1

    def cancel(self, request_id: str, owner: str) -> bool:
        """Stop holding `owner`'s unfinished request for a client: its result, when it comes, is dropped. The
        coordinator still runs it (an accepted request is not aborted). False if there is nothing to cancel."""
        promise = self._promises.get(request_id)
        if promise is None or promise.owner != owner or promise.reply is not None:
            return False
        self.forget(request_id)
        return True

    def deliver(self, done: m.RequestDone) -> None:
        """A result pushed by the coordinator; rendering runs as a task so the push never waits on it."""
        if isinstance(done, m.Notice):
            log.info("%s: %s", done.request_id, done.message)
            if (promise := self._promises.get(done.request_id)) is not None:
                promise.notice, promise.notice_at = done.message, time.monotonic()
            return
        promise = self._promises.get(done.request_id)
        if promise is None or promise.reply is not None:
            log.debug("result for %s has no open promise; dropped", done.request_id)
            return
        if done.error is not None:
            self.fail(done.request_id, done.error)
            return
        task = asyncio.get_running_loop().create_task(self._render(promise, done.result))
        self._rendering.add(task)
        task.add_done_callback(self._rendering.discard)

    async def _render(self, promise: Promise, result: Any) -> None:
        try:
            reply = await promise.render(result)
        except Exception as exc:
            log.exception("could not render the result of %s", promise.request_id)
            error = RemoteError.from_exception(exc)
            reply = json_reply(json_wire.failure(error))
        self.settle(promise.request_id, reply)

    def fail(self, request_id: str, error: RemoteError) -> None:
        promise = self._promises.get(request_id)
        if promise is not None and promise.reply is None:
            promise.failed = True
            self.settle(request_id, json_reply(json_wire.failure(error)))

    def settle(self, request_id: str, reply: Reply) -> None:
        promise = self._promises.get(request_id)
        if promise is not None and promise.reply is None:
            promise.reply = reply
            promise.ready.set()
            self._pending -= 1
            for listener in self.listeners:
                listener(promise)

    def waiting_reason(self, request_id: str) -> str | None:
        """Why a pending request waits, if the coordinator said so lately: it repeats a reason that still holds
        at least every `PROGRESS_EVERY_S`, so an older one may no longer be true."""
        promise = self._promises.get(request_id)
        if promise is None or promise.notice is None or promise.reply is not None:
            return None
        return promise.notice if time.monotonic() - promise.notice_at <= NOTICE_FRESH_S else None

    async def wait(self, request_id: str, owner: str, timeout_s: float) -> Reply | None:
        """The reply once ready, or None after `timeout_s` (or at shutdown). KeyError for an id unknown to `owner`."""
        promise = self._promises[request_id]
        if promise.owner != owner:
            raise KeyError(request_id)
        if promise.reply is None and not self._closed:
            try:
                async with asyncio.timeout(timeout_s):
                    await promise.ready.wait()
            except TimeoutError:
                return None
        if promise.reply is not None and promise.served_at is None:
            promise.served_at = time.monotonic()
        return promise.reply

    def pending(self) -> int:
        """Promises still waiting for their result."""
        return self._pending

    def sweep(self) -> int:
        """Drop replies served long enough ago, and results nobody came for; returns how many went."""
        now = time.monotonic()
        stale = [
            rid for rid, p in self._promises.items()
            if p.reply is not None and (
                (p.served_at is not None and now - p.served_at > self.keep_served_s)
                or (p.served_at is None and now - p.created > self.keep_unclaimed_s)
            )
        ]
        for rid in stale:
            del self._promises[rid]
        return len(stale)

    def close(self) -> None:
        """Wake every waiting poll (each answers try_again) so the server can stop."""
        self._closed = True
        for promise in self._promises.values():
            promise.ready.set()
