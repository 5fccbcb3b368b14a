"""The coordinator's endpoint for clients: one ROUTER socket for the native SDK (in-process front ends, the HTTP
gateway, attach to the front door). It answers Hello (protocol, API key, session), checks that every later
message comes from the connection that said it, and hands requests, session calls and queries to the front door;
answers come back through `push`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from bios import __version__
from bios import messages as m
from bios.actors.remote import answered
from bios.exceptions import (
    AuthenticationError,
    BadRequestError,
    NotFoundError,
    ReconnectRequired,
)
from bios.transport.codec import Envelope
from bios.transport.sockets import Router

from .accounts import Accounts
from .front_door import FrontDoor


@dataclass(frozen=True)
class Caller:
    """Who a client connection is: the owner of its work (its key's id) and, with keys, the CurveZMQ public key
    its Hello came from, so no other connection can speak for it."""

    owner: str
    connection_key: str | None


class ClientEndpoint:
    def __init__(self, router: Router, accounts: Accounts, cycle_s: float, worker_port: Callable[[], int],
                 ping: Callable[[m.Ping], Awaitable[m.Pong]]) -> None:
        self.router = router
        self.accounts = accounts
        self.cycle_s = cycle_s
        self.worker_port = worker_port  # where workers register (a client may start one: `bios up`)
        self.ping = ping  # a client's Ping is answered by a worker
        self.front_door: FrontDoor  # set by the assembly once built (its scheduler pushes through this endpoint)
        self.sessions: dict[bytes, str] = {}
        self.callers: dict[bytes, Caller] = {}

    def dispatch(self, peer: bytes, env: Envelope, frames: list[Any]) -> Any:
        body = env.body
        if isinstance(body, m.Hello):
            return self._hello(peer, body, frames)
        if isinstance(body, m.DiscoverWorkerEndpoint):
            return answered(m.WorkerEndpoint(self.worker_port()))
        caller = self.callers.get(peer)
        if caller is None or caller.connection_key != self._connection_key(frames):
            raise ReconnectRequired("this coordinator does not know this connection (it restarted, or the "
                                    "connection never said Hello): say Hello again, resuming the session")
        if isinstance(body, m.REQUEST_TYPES):
            return self.front_door.submit(peer, body, caller.owner, [f.bytes for f in frames])
        if isinstance(body, m.SessionHeartbeat):
            if not self.accounts.is_active(caller.owner):
                self._forget(peer)
                raise AuthenticationError("this session's API key was revoked")
            if not self.front_door.heartbeat(body.session_id, caller.owner):
                raise NotFoundError(f"session {body.session_id} is closed or unknown")
            return answered(m.Ack())
        if isinstance(body, m.CloseSession):
            self.front_door.close_session(body.session_id, caller.owner)
            self._forget(peer)
            return answered(m.Ack())
        if self.front_door.is_query(body):
            return self.front_door.query(body, caller.owner)
        if isinstance(body, m.Ping):
            return self.ping(body)
        raise BadRequestError(f"the coordinator does not take {type(body).__name__} from clients", field="kind")

    def _hello(self, peer: bytes, hello: m.Hello, frames: list[Any]) -> asyncio.Future[Any]:
        if hello.protocol != m.PROTOCOL_VERSION:
            raise BadRequestError(
                f"client speaks protocol {hello.protocol}, this coordinator speaks {m.PROTOCOL_VERSION}; "
                "upgrade the older side",
                field="protocol",
            )
        caller = Caller(self.accounts.authenticate(hello.api_key), self._connection_key(frames))
        known = self.callers.get(peer)
        if known is not None and known != caller:
            raise AuthenticationError("this connection already has a session with another key; reconnect instead")
        session_id = self.sessions.get(peer)
        if session_id is None:
            if hello.session_id is not None:  # the same client, back after a reconnect or a restart
                self.front_door.resume_session(hello.session_id, caller.owner)
                session_id = hello.session_id
            else:
                session_id = self.front_door.open_session(caller.owner)
            self.sessions[peer] = session_id
            self.callers[peer] = caller
        return answered(m.Welcome(session_id, __version__, self.cycle_s))

    def _connection_key(self, frames: list[Any]) -> str | None:
        """The CurveZMQ public key the message came from (set by the ZAP handler); None without keys."""
        return frames[0].get("User-Id") if self.accounts.keys_required else None

    def _forget(self, peer: bytes) -> None:
        self.sessions.pop(peer, None)
        self.callers.pop(peer, None)

    async def push(self, peer: bytes, frames: list[Any]) -> None:
        """An answer (or notice) for `peer`: over the socket, or to an in-process front end (the front door's)."""
        if not self.front_door.answer_local(peer, frames):
            await self.router.send_raw(peer, frames)
