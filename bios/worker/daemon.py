"""The worker process: registers with the coordinator, heartbeats, and runs cycles on a compute thread.

The event loop only moves messages; all torch work happens on one compute thread (the `Trainer` actor hands
cycles to it), so heartbeats keep flowing while a long cycle runs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import psutil
import torch
import zmq
import zmq.asyncio

from bios import messages as m
from bios import wire
from bios.actors.actor import Actor, Policy, spawn
from bios.actors.remote import RemoteRef
from bios.exceptions import AuthenticationError, RemoteError
from bios.models import list_models
from bios.security.handshake import MECHANISM_MISMATCH, REFUSED, UNREADABLE, HandshakeWatch
from bios.security.keys import WorkerToken
from bios.transport.codec import Envelope
from bios.transport.sockets import Dealer, Security

from .collectives import CollectiveError, CollectiveGroup
from .executor import CycleExecutor, CycleOutcome
from .interfaces import advertised_host
from .memory_plan import runtime_footprint
from .pool import ModelPool

log = logging.getLogger(__name__)

LEAVE_TIMEOUT_S = 120.0  # exit anyway if the coordinator never answers a leave
# A registration the coordinator does not answer within this is sent again: it may have died (and restarted)
# between receiving it and answering, and the worker must not wait on a dead one or exit.
REGISTER_TIMEOUT_S = 5.0
# A handshake that fails without a reason is what a coordinator killed mid-handshake looks like, and also what a
# coordinator that now wants a key it does not have looks like: re-registering, a worker believes the second
# only after this many such failures in a row.
HANGUP_RETRIES = 5


def default_device() -> torch.device:
    """CUDA when present (one worker per GPU), else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(psutil.virtual_memory().total)


@dataclass(frozen=True)
class WorkerConfig:
    coordinator: str
    device: torch.device
    worker_id: str = ""
    token: str | None = None
    discover_timeout_s: float = 60.0
    memory_limit: int | None = None  # bytes reported as this worker's budget instead of the device's memory


class Trainer(Actor):
    """Owns the model pool and the collective group; runs cycles and reconfigurations one at a time on the
    compute thread, reporting items as they finish."""

    def __init__(self, identity: Callable[[], str], pool: ModelPool, group: CollectiveGroup, send: Any) -> None:
        self.identity = identity  # the worker's current id: it changes when the worker registers again
        self.executor = CycleExecutor(pool, group)
        self.send = send
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self.last_cycle: m.HeldCycle | None = None  # what a restarted coordinator may need of the last commit

    async def held_adapters(self) -> tuple[dict[str, float], m.HeldCycle | None]:
        """The checksums of the adapters it holds and what it keeps of its last cycle (asked after any queued
        cycle, so it reports what they left)."""
        holdings = await asyncio.get_running_loop().run_in_executor(self.thread, self.executor.held_checksums)
        return holdings, self.last_cycle if holdings else None

    async def reconfigure(self, message: m.Reconfigure) -> None:
        """Join a new generation; the coordinator hears `Reconfigured`, with an error if it could not."""
        loop = asyncio.get_running_loop()
        try:
            checksums = await loop.run_in_executor(self.thread, self.executor.reconfigure, message)
        except Exception as exc:
            if isinstance(exc, CollectiveError):  # the network, not a bug: its message says what to set
                log.error("%s", exc)
            else:
                log.exception("could not join generation %d", message.generation)
            await self.send(m.Reconfigured(message.generation, self.identity(), {}, error=str(exc)))
        else:
            await self.send(m.Reconfigured(message.generation, self.identity(), checksums))

    async def run_cycle(self, message: m.RunCycle) -> None:
        """Run one cycle, reporting each item as it finishes and `CycleDone` at the end."""
        loop = asyncio.get_running_loop()
        reported: list[m.ItemDone] = []

        def report(done: m.ItemDone | m.SampleProgress) -> None:
            if isinstance(done, m.ItemDone):  # (progress is not a result: nothing to hold across a restart)
                reported.append(done)
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.send(done)))

        outcome = CycleOutcome(True, "the cycle crashed on this worker", {})
        try:
            outcome = await loop.run_in_executor(self.thread, self.executor.run, message, report)
            if not outcome.aborted:
                self.last_cycle = m.HeldCycle(message.cycle_id, outcome.before, reported)
        finally:
            await asyncio.sleep(0)  # let the reports queued by the compute thread go out first
            await self.send(m.CycleDone(message.cycle_id, self.identity(), outcome.aborted, outcome.reason,
                                        outcome.checksums, outcome.seconds))

    async def stopped(self) -> None:
        self.thread.shutdown(wait=False, cancel_futures=True)


class _HandshakeFailed(Exception):
    """A registration's handshake failed; `WorkerDaemon.run` decides whether that is worth another try."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class WorkerDaemon:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.base_id = config.worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.worker_id = self.base_id
        self.ctx = zmq.asyncio.Context()
        self.codec = wire.make_codec()
        self.pool = ModelPool(config.device)
        self.group = CollectiveGroup(config.device, advertised_host(config.coordinator))
        self.stop_requested = asyncio.Event()
        self.rejoin_requested = asyncio.Event()
        self.remote: RemoteRef | None = None
        # With a token, both connections are CurveZMQ-encrypted under the key pair the token derives.
        self.security: Security | None = None
        if config.token:
            self.security = WorkerToken.parse(config.token).worker_security()

    async def run(self) -> None:
        address = await self._worker_address()
        self.trainer = spawn(lambda: Trainer(lambda: self.worker_id, self.pool, self.group, self._send),
                             name="trainer", policy=Policy.RESUME)
        rejoins = hangups = 0
        while True:
            try:
                heartbeat = await self._register(address)
                hangups = 0
            except asyncio.TimeoutError:
                log.warning("the coordinator did not answer this worker's registration within %.0fs (restarting?): "
                            "registering again", REGISTER_TIMEOUT_S)
                await self._disconnect()
                continue
            except _HandshakeFailed as failed:
                await self._disconnect()
                if failed.reason != UNREADABLE or rejoins == 0 or hangups >= HANGUP_RETRIES:
                    raise self._refused(failed.reason) from None
                hangups += 1
                log.warning("the coordinator hung up during this worker's handshake (restarting?): registering again")
                await asyncio.sleep(1.0)
                continue
            stop = asyncio.ensure_future(self.stop_requested.wait())
            rejoin = asyncio.ensure_future(self.rejoin_requested.wait())
            await asyncio.wait({stop, rejoin}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            rejoin.cancel()
            heartbeat.cancel()
            if self.stop_requested.is_set():
                break
            await self._disconnect()
            # A new identity: the coordinator treats it as a newcomer whose state is replaced by the current one,
            # unless no holder survived and this worker's checksums equal the last committed ones.
            rejoins += 1
            self.worker_id = f"{self.base_id}-rejoin{rejoins}"
            self.rejoin_requested.clear()
        await self.trainer.stop()
        assert self.remote is not None
        await self.remote.close()
        self.ctx.term()

    async def _register(self, address: str) -> asyncio.Task[None]:
        """Connect under the current worker id, register, and start heartbeats (the returned task)."""
        holdings, last_cycle = await self.trainer.ask(Trainer.held_adapters)
        dealer = Dealer(self.ctx, self.codec, identity=self.worker_id.encode(), security=self.security)
        watch = HandshakeWatch(dealer.sock)
        dealer.connect(address)
        self.remote = RemoteRef(dealer, on_message=self._on_message).start()
        register = self.remote.ask(
            m.RegisterWorker(
                worker_id=self.worker_id,
                host=socket.gethostname(),
                pid=os.getpid(),
                device=str(self.config.device),
                memory_bytes=self.config.memory_limit or device_memory(self.config.device),
                token=self.config.token,
                models=[entry.name for entry in list_models()],
                store_host=self.group.host,
                store_port=self.group.store_port,
                runtime_bytes=runtime_footprint(self.config.device),
                holdings=holdings,
                last_cycle=last_cycle,
            ),
            timeout=REGISTER_TIMEOUT_S,
        )
        accepted = await watch.guard(register, _HandshakeFailed)
        log.info("worker %s registered at %s on %s", self.worker_id, address, self.config.device)
        return asyncio.get_running_loop().create_task(self._heartbeat(accepted.heartbeat_interval_s))

    async def _disconnect(self) -> None:
        remote, self.remote = self.remote, None
        if remote is not None:
            await remote.close()

    async def leave(self, reason: str) -> None:
        """Ask to leave; the coordinator lets the cycle in progress finish, then answers with Shutdown."""
        if self.remote is None:
            self.stop_requested.set()
            return
        await self.remote.tell(m.Leaving(self.worker_id, reason))
        asyncio.get_running_loop().call_later(LEAVE_TIMEOUT_S, self.stop_requested.set)

    async def _worker_address(self) -> str:
        """Ask the coordinator's client address where workers connect (same host, its worker port)."""
        dealer = Dealer(self.ctx, self.codec, security=self.security)
        watch = HandshakeWatch(dealer.sock)
        dealer.connect(self.config.coordinator)
        probe = RemoteRef(dealer).start()
        try:
            endpoint = await watch.guard(probe.ask(m.DiscoverWorkerEndpoint(), timeout=self.config.discover_timeout_s),
                                         self._refused)
        except asyncio.TimeoutError:
            raise ConnectionError(f"no coordinator answered at {self.config.coordinator}") from None
        finally:
            await probe.close()
        host = self.config.coordinator.rsplit(":", 1)[0]
        return f"{host}:{endpoint.port}"

    def _refused(self, reason: str) -> AuthenticationError:
        """Why the coordinator refused this worker's handshake, as something the operator can fix."""
        where = f"the coordinator at {self.config.coordinator}"
        if self.security is None:  # a keyless coordinator never refuses a plain handshake
            return AuthenticationError(f"{where} requires a worker token: pass --token or set BIOS_WORKER_TOKEN "
                                       "(print it on the coordinator's host with `bios keys worker-token`)")
        if reason == MECHANISM_MISMATCH:
            return AuthenticationError(f"{where} runs without keys: start this worker without --token")
        if reason == REFUSED:
            return AuthenticationError(f"{where} refused this worker's token: print the current one with "
                                       "`bios keys worker-token` on the coordinator's host")
        return AuthenticationError(f"this worker token is not for {where}: it belongs to another cluster, or that "
                                   "coordinator runs without keys")

    async def _heartbeat(self, interval: float) -> None:
        assert self.remote is not None
        while True:
            await self.remote.tell(m.WorkerHeartbeat(self.worker_id))
            await asyncio.sleep(interval)

    async def _send(self, body: Any) -> None:
        if self.remote is None:
            log.debug("not connected (registering again): %s dropped", type(body).__name__)
            return  # it reports on a cycle or generation the coordinator no longer counts this worker in
        await self.remote.tell(body)

    def _on_message(self, env: Envelope) -> None:
        body = env.body
        if isinstance(body, (m.RunCycle, m.Reconfigure)):
            if self.trainer.running:
                self.trainer.tell(Trainer.run_cycle if isinstance(body, m.RunCycle) else Trainer.reconfigure, body)
            else:
                log.warning("leaving: %s not started here", type(body).__name__)
        elif isinstance(body, m.AbortGeneration):  # here, not in the trainer's mailbox: its thread may be waiting
            log.warning("generation %d aborted: %s", body.generation, body.reason)
            self.group.abort(body.epoch, body.generation, body.reason)
        elif isinstance(body, m.Ping):
            asyncio.ensure_future(self._reply(env, m.Pong(body.payload)))
        elif isinstance(body, m.Shutdown):
            log.info("coordinator asked this worker to exit: %s", body.reason)
            self.stop_requested.set()
        elif isinstance(body, m.Rejoin):
            if not self.rejoin_requested.is_set():
                log.warning("registering again: %s", body.reason)
                self.rejoin_requested.set()
        elif isinstance(body, RemoteError):
            log.warning("coordinator reported: %s: %s", body.type, body.message)
        else:
            log.warning("ignored unexpected %s from the coordinator", type(body).__name__)

    async def _reply(self, env: Envelope, body: Any) -> None:
        assert self.remote is not None
        await self.remote.reply(env, body)
