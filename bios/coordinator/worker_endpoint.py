"""The coordinator's endpoint for workers: one ROUTER socket, registration and heartbeats (`Membership`),
worker reports to their group's cycle runner (`Groups`), and the sends and asks the runners make of workers."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from bios import messages as m
from bios.actors.remote import answered
from bios.exceptions import BadRequestError, RequestFailedError
from bios.security.keys import KeyStore
from bios.transport.codec import Envelope
from bios.transport.sockets import Router, next_message_id

from .groups import Groups
from .membership import Member, Membership

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 1.0


class WorkerEndpoint:
    def __init__(self, router: Router, membership: Membership, keys: KeyStore | None, heartbeat_s: float) -> None:
        self.router = router
        self.membership = membership
        self.keys = keys
        self.heartbeat_s = heartbeat_s  # how often a worker is told to send its heartbeat
        self.groups: Groups  # set by the assembly once built (the groups send through this endpoint)
        self._asks: dict[int, asyncio.Future[Any]] = {}

    def dispatch(self, peer: bytes, env: Envelope, frames: list[Any]) -> Any:
        body = env.body
        if env.reply_to is not None and env.reply_to in self._asks:
            future = self._asks.pop(env.reply_to)
            if not future.done():
                future.set_result(body)
            return None
        if isinstance(body, m.RegisterWorker):
            if self.keys is not None:
                self.keys.check_worker_token(body.token)
            self.membership.register(peer, body)
            return answered(m.WorkerAccepted(self.heartbeat_s))
        worker_id = self._worker_id(peer)
        if worker_id is None:
            log.info("a message from a worker that is not a member (%s): asking it to register again",
                     type(body).__name__)
            return asyncio.ensure_future(self.send(peer, m.Rejoin(
                "this worker is not a member of the cluster (it was declared dead or never registered)")))
        if isinstance(body, m.WorkerHeartbeat):
            self.membership.heartbeat(worker_id, peer)
        elif isinstance(body, m.ItemDone):
            self.groups.item_done(worker_id, body)
        elif isinstance(body, m.SampleProgress):
            self.groups.sample_progress(worker_id, body)
        elif isinstance(body, m.CycleDone):
            self.groups.worker_done(worker_id, body)
        elif isinstance(body, m.Reconfigured):
            self.groups.reconfigured(worker_id, body)
        elif isinstance(body, m.Leaving):
            member = self.membership.mark_leaving(worker_id, body.reason)
            if member is not None:
                self.groups.leaving(member)
        elif isinstance(body, m.Shutdown):
            self.membership.mark_dead(worker_id, f"left: {body.reason}")
            self.groups.worker_lost(self.membership.members[worker_id])
        else:
            raise BadRequestError(f"the coordinator does not take {type(body).__name__} from workers", field="kind")
        return None

    def _worker_id(self, peer: bytes) -> str | None:
        for member in self.membership.members.values():
            if member.peer == peer and member.state != "dead":
                return member.worker_id
        return None

    async def send(self, peer: bytes, body: Any) -> None:
        await self.router.send(peer, Envelope(next_message_id(), body))

    async def ask(self, peer: bytes, body: Any, timeout: float) -> Any:
        env_id = next_message_id()
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._asks[env_id] = future
        try:
            await self.router.send(peer, Envelope(env_id, body))
            async with asyncio.timeout(timeout):
                return await future
        finally:
            self._asks.pop(env_id, None)

    async def ping_any(self, ping: m.Ping) -> m.Pong:
        """A client's Ping, answered by a live worker."""
        members = self.membership.alive()
        if not members:
            raise RequestFailedError("no worker is connected to this coordinator")
        return await self.ask(members[0].peer, ping, timeout=self.membership.heartbeat_timeout_s)

    async def probe(self, member: Member) -> bool:
        """Whether `member` answers a ping now (a failed collective makes a peer's death likely)."""
        try:
            await self.ask(member.peer, m.Ping(), timeout=PROBE_TIMEOUT_S)
        except (asyncio.TimeoutError, TimeoutError):
            return False
        return True

    async def shutdown_all(self, reason: str) -> None:
        """Tell every live worker to exit."""
        for member in self.membership.alive():
            try:
                await self.send(member.peer, m.Shutdown(reason))
            except Exception as exc:  # a closing socket: the worker hears of it at its next heartbeat
                log.debug("could not tell %s to exit: %s", member.worker_id, exc)

