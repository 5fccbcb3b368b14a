"""The coordinator's one front door: sessions, request submission and queries, for every client front end.

The native ZeroMQ endpoint and the Tinker HTTP gateway both come in here, so a request means the same whichever
way it arrives, and neither touches the store or the scheduler's internals.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from bios import messages as m
from bios.actors.actor import ActorRef
from bios.actors.remote import answered
from bios.exceptions import BadRequestError, NotFoundError
from bios.security.limits import QuotaLedger
from bios.transport.codec import Codec, Envelope
from bios.transport.sockets import next_message_id

from .accounts import LOCAL_OWNER
from .admission import Submit
from .queries import ACCOUNT_TYPES, Queries
from .queries import QUERY_TYPES as READ_QUERIES
from .scheduler import Scheduler
from .store import Store

# The queries about what the scheduler holds in memory: each its method, called with (owner, query).
SCHEDULER_QUERIES: dict[type, Callable[..., Any]] = {
    m.GetInfo: Scheduler.get_info,
    m.CreateSamplingSession: Scheduler.create_sampler,
    m.GetSamplingSession: Scheduler.get_sampler,
}


class FrontDoor:
    def __init__(self, store: Store, scheduler: ActorRef, queries: Queries, ledger: QuotaLedger, codec: Codec,
                 capabilities: Callable[[], Any], status: Callable[[], Awaitable[m.ClusterStatus]]) -> None:
        self.store = store
        self.scheduler = scheduler
        self.queries = queries
        self.ledger = ledger
        self.codec = codec
        self.capabilities = capabilities
        self.status = status
        self.seen: dict[str, float] = {}  # session id -> when this coordinator last heard from it
        self._local: dict[bytes, Callable[[m.RequestDone], None]] = {}  # in-process front ends' answer callbacks

    # ------------------------------------------------------------------------------------ in-process front ends

    def attach(self, name: str, on_done: Callable[[m.RequestDone], None]) -> bytes:
        """Register an in-process front end (the HTTP gateway, its OpenAI routes): the peer it submits as; its
        answers come to `on_done`."""
        peer = f"local:{name}".encode()
        self._local[peer] = on_done
        return peer

    def answer_local(self, peer: bytes, frames: list[Any]) -> bool:
        """Hand an answer to the in-process front end `peer` (True), or say it is not one (False)."""
        on_done = self._local.get(peer)
        if on_done is None:
            return False
        on_done(self.codec.decode(frames).body)
        return True

    # ------------------------------------------------------------------------------------ sessions

    def open_session(self, owner: str = LOCAL_OWNER) -> str:
        session_id = uuid.uuid4().hex[:16]
        self.store.add_session(session_id, owner)
        self.seen[session_id] = time.monotonic()
        return session_id

    def owns_session(self, session_id: str, owner: str) -> bool:
        return self.store.session_owner(session_id) == owner

    def check_session(self, session_id: str, owner: str) -> None:
        if not self.owns_session(session_id, owner):
            raise NotFoundError(f"unknown session {session_id!r}; create one with a ServiceClient",
                                field="session_id")

    def resume_session(self, session_id: str, owner: str) -> None:
        """A client back after a reconnect or a coordinator restart keeps its session (its runs, its seq_ids)."""
        if not self.heartbeat(session_id, owner):
            raise NotFoundError(f"session {session_id} was closed; create a new ServiceClient", field="session_id")

    def heartbeat(self, session_id: str, owner: str) -> bool:
        """False when the session was closed."""
        self.check_session(session_id, owner)
        self.seen[session_id] = time.monotonic()
        return self.store.touch_session(session_id)

    def close_session(self, session_id: str, owner: str) -> None:
        self.check_session(session_id, owner)
        self.store.close_session(session_id)
        self.seen.pop(session_id, None)

    def expire_sessions(self, timeout_s: float) -> list[str]:
        """Close the sessions not heard from for `timeout_s` (their runs and checkpoints stay); returns them."""
        limit = time.monotonic() - timeout_s
        expired = [session_id for session_id, seen in self.seen.items() if seen < limit]
        for session_id in expired:
            self.store.close_session(session_id)
            del self.seen[session_id]
        return expired

    def expire_checkpoints(self) -> list[str]:
        """Delete the checkpoints past their TTL; returns their paths."""
        return self.queries.expire_checkpoints()

    def sessions(self, owner: str) -> list[str]:
        return self.queries.sessions(owner)

    def runs_of_session(self, session_id: str, owner: str) -> list[str]:
        self.check_session(session_id, owner)
        return self.queries.runs_of_session(session_id, owner)

    def samplers_of_session(self, session_id: str, owner: str) -> list[str]:
        self.check_session(session_id, owner)
        return self.queries.samplers_of_session(session_id, owner)

    def run_ids(self, owner: str) -> list[str]:
        return self.queries.run_ids(owner)

    # ------------------------------------------------------------------------------------ requests

    def submit(self, peer: bytes, op: m.Request, owner: str = LOCAL_OWNER,
               frames: list[bytes] | None = None) -> asyncio.Future[Any]:
        """Admit a request (validated, stored, ordered); resolves to `Accepted`, or the error that refused it.

        RateLimitError, before anything else, if the key already has too many requests arriving."""
        if frames is None:
            frames = [bytes(f) for f in self.codec.encode(Envelope(next_message_id(), op))]
        self.ledger.arrive(owner)
        future = self.scheduler.ask_future(Scheduler.submit, Submit(peer, owner, op, frames))
        future.add_done_callback(lambda _f: self.ledger.arrived(owner))
        return future

    def watch(self, peer: bytes, request_id: str, owner: str = LOCAL_OWNER) -> asyncio.Future[Any]:
        """Send `peer` the result of a request it submitted to an earlier coordinator (now, or when it comes);
        NotFoundError if `owner` has no such request."""
        return self.scheduler.ask_future(Scheduler.watch, peer, owner, request_id)

    def query(self, body: Any, owner: str = LOCAL_OWNER) -> asyncio.Future[Any]:
        """Answer a query (GetInfo, sampling sessions, listings, capabilities, status) for `owner`."""
        asked = SCHEDULER_QUERIES.get(type(body))
        if asked is not None:
            return self.scheduler.ask_future(asked, owner, body)
        if isinstance(body, READ_QUERIES):
            return answered(self.queries.answer(owner, body))
        if isinstance(body, m.GetServerCapabilities):
            return answered(self.capabilities())
        if isinstance(body, m.GetClusterStatus):
            return asyncio.ensure_future(self.status())
        raise BadRequestError(f"{type(body).__name__} is not a query", field="kind")

    def read_any_owner(self, body: Any) -> Any:
        """A read-only query over every key's runs, usage and audit log: the admin's view."""
        if not isinstance(body, (m.ListRunSummaries, m.GetTrainingRunMetrics, m.ListCheckpoints, *ACCOUNT_TYPES)):
            raise BadRequestError(f"{type(body).__name__} is not a read-only listing", field="kind")
        return self.queries.answer(None, body)

    @staticmethod
    def is_query(body: Any) -> bool:
        return isinstance(body, (*SCHEDULER_QUERIES, *READ_QUERIES, m.GetServerCapabilities, m.GetClusterStatus))

