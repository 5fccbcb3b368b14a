"""The coordinator process: two ROUTER sockets (clients, workers) feeding the scheduler and the cycle runner."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from bios import __version__, cluster_defaults
from bios import messages as m
from bios import types as t
from bios.actors.actor import ActorRef, Policy, spawn
from bios.actors.remote import serve
from bios.exceptions import (
    AuthenticationError,
    BadRequestError,
    NotFoundError,
    ReconnectRequired,
    RequestFailedError,
)
from bios.security.keys import KeyInfo, KeyStore
from bios.security.limits import QuotaLedger, Quotas
from bios.security.listen import check_listen
from bios.security.zap import CLIENT_DOMAIN, WORKER_DOMAIN, ZapHandler
from bios.transport.codec import Envelope, Limits
from bios.transport.sockets import Router, next_message_id

from .clock import CycleClock
from .cycles import CycleRunner
from .generations import GenerationFormer
from .groups import Groups
from .roster import Roster
from .membership import Membership
from .metrics import CoordinatorMetrics
from .audit import AuditLog
from .catalog import Catalog
from .checkpoints import DirectoryCheckpointStore
from .front_door import LOCAL_OWNER, FrontDoor
from .queries import Queries
from .mailbox import PlanDescriptions, QueueDepth
from .scheduler import Scheduler, SchedulerConfig
from .labels import Labels
from .store import Store
from .usage import Usage
from .watchdog import Watchdog

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 1.0
# After a restart, the first generation waits up to this many heartbeat timeouts for a worker that kept the
# runs' state to register again (workers notice the restart at their next heartbeat).
REJOIN_GRACE_HEARTBEATS = 2


@dataclass(frozen=True)
class CoordinatorConfig:
    listen: str = "tcp://127.0.0.1:7600"
    worker_port: int | None = None  # None: the client port + 1, or a free port when the client port is 0
    state_dir: Path = Path("bios-state")
    cycle_s: float = 10.0
    heartbeat_timeout_s: float = 5.0
    # How long a worker's collective may wait for a peer that is alive but busier (liveness is the heartbeats').
    collective_timeout_s: float = cluster_defaults.COLLECTIVE_TIMEOUT_S
    session_timeout_s: float = 600.0  # longer than the SDK's reconnect patience, so a returning client resumes
    stalled_after_s: float = 300.0  # the watchdog reports requests queued longer than this
    seq_gap_s: float = 120.0  # requests waiting this long behind a seq_id that never came are withdrawn
    worker_heartbeat_s: float = 1.0
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    quotas: Quotas = Quotas()


@dataclass(frozen=True)
class Addresses:
    clients: str
    workers: str


@dataclass(frozen=True)
class Caller:
    """Who a client connection is: the owner of its work (its key's id) and, with keys, the CurveZMQ public key
    its Hello came from, so no other connection can speak for it."""

    owner: str
    connection_key: str | None


class Coordinator:
    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.keys = KeyStore.open(config.state_dir)
        check_listen(config.listen, keys=self.keys is not None)
        self.ctx = zmq.asyncio.Context()
        self.codec = m.make_codec()
        client_codec = m.make_codec(Limits(max_message_bytes=config.quotas.max_message_bytes))
        self.zap: ZapHandler | None = None
        if self.keys is None:  # a ZAP domain without a handler admits everyone, but makes libzmq hang up at once
            # on a peer that is not ZeroMQ 3 (an HTTP client such as the Tinker SDK at the wrong port), as with keys
            self.clients = Router(self.ctx, client_codec, zap_domain=CLIENT_DOMAIN)
            self.workers = Router(self.ctx, self.codec, zap_domain=WORKER_DOMAIN)
        else:  # CurveZMQ on both sockets; the ZAP handler admits only token holders to the worker socket
            security = self.keys.cluster.server_security()
            self.zap = ZapHandler(self.ctx, self.keys.cluster.worker_token().curve_public_key())
            self.clients = Router(self.ctx, client_codec, security=security, zap_domain=CLIENT_DOMAIN)
            self.workers = Router(self.ctx, self.codec, security=security, zap_domain=WORKER_DOMAIN)
        self.ledger = QuotaLedger(config.quotas)
        self.store = Store(config.state_dir)
        self.catalog = Catalog(self.store, DirectoryCheckpointStore(config.state_dir / "checkpoints"))
        self.usage = Usage(self.store)  # per-key accounting and the audit log start with the state dir
        self.audit = AuditLog(self.store.db)
        self.labels = Labels(self.store)
        self.membership = Membership(config.heartbeat_timeout_s)
        self.metrics = CoordinatorMetrics()
        self.sessions: dict[bytes, str] = {}
        self.callers: dict[bytes, Caller] = {}
        self._worker_asks: dict[int, asyncio.Future[Any]] = {}
        self._local_clients: dict[bytes, Callable[[m.RequestDone], None]] = {}
        self._tasks: list[asyncio.Task[Any]] = []
        self._started = time.monotonic()
        self.scheduler: ActorRef
        self.runner: Groups

    async def start(self) -> Addresses:
        if self.zap is not None:
            self.zap.start()
        clients = self.clients.bind(self.config.listen)
        client_port = int(clients.rsplit(":", 1)[1])
        host = clients.rsplit(":", 1)[0]
        worker_port = self.config.worker_port
        if worker_port is None:
            worker_port = 0 if self.config.listen.endswith(":0") else client_port + 1
        workers = self.workers.bind(f"{host}:{worker_port}")
        scheduling = SchedulerConfig(self.config.checkpoint_every, self.config.keep_checkpoints)
        self.scheduler = spawn(
            lambda: Scheduler(self.store, self.catalog, self.codec, self._push, lambda: self.runner.work_queued(),
                              scheduling, self.ledger, self.metrics, workers=self.membership.alive),
            name="scheduler",
            policy=Policy.RESUME,
        )
        queries = Queries(self.store, self.catalog, self._keys)
        self.front_door = FrontDoor(self.store, self.scheduler, queries, self.ledger, self.codec, self._capabilities,
                                    self._status)
        self.runner = Groups(self.scheduler, self.membership, self._make_runner, self.config.cycle_s,
                             self._send_to_worker)
        watchdog = Watchdog(self.membership, self.runner, self.scheduler, self.front_door,
                            heartbeat_timeout_s=self.config.heartbeat_timeout_s,
                            session_timeout_s=self.config.session_timeout_s,
                            stalled_after_s=self.config.stalled_after_s, seq_gap_s=self.config.seq_gap_s)
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(serve(self.clients, self._dispatch_client), name="clients"),
            loop.create_task(serve(self.workers, self._dispatch_worker), name="workers"),
            loop.create_task(self.runner.run_forever(), name="groups"),
            loop.create_task(watchdog.watch_heartbeats(), name="heartbeats"),
            loop.create_task(watchdog.watch_progress(), name="progress"),
            loop.create_task(watchdog.watch_gaps(), name="gaps"),
        ]
        log.info("coordinator serving clients on %s and workers on %s (cycle_s=%s)", clients, workers, self.config.cycle_s)
        return Addresses(clients, workers)

    def _make_runner(self, group_id: str, clock: CycleClock, roster: Roster, epoch: str) -> CycleRunner:
        """The cycle runner of one group of workers (`bios.coordinator.groups`) and its generations."""
        generations = GenerationFormer(
            group_id, self.scheduler, self.membership, roster, self._send_to_worker, self._load_state,
            self._latest_checkpoint, self._probe,
            join_timeout_s=self.config.heartbeat_timeout_s,
            epoch=epoch,
            collective_timeout_s=self.config.collective_timeout_s,
            committed=self.store.committed(),
            rejoin_grace_s=max(0.0, self._started + REJOIN_GRACE_HEARTBEATS * self.config.heartbeat_timeout_s
                               - time.monotonic()),  # only the groups formed right after a restart wait
        )
        return CycleRunner(group_id, self.scheduler, clock, self.membership, roster, generations,
                           self._send_to_worker, self._load_state, self._probe, self.metrics)

    async def wait(self) -> None:
        """Run until a serving task fails (which is a bug: it is logged and re-raised)."""
        done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()

    async def stop(self) -> None:
        """Tell every worker to exit, then close."""
        for member in self.membership.alive():
            with contextlib.suppress(Exception):
                await self._send_to_worker(member.peer, m.Shutdown("coordinator stopping"))
        await asyncio.sleep(0.05)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.scheduler.stop()
        self.clients.close()
        self.workers.close()
        if self.zap is not None:
            await self.zap.stop()
        if self.keys is not None:
            self.keys.close()
        self.store.close()
        self.ctx.term()

    # ------------------------------------------------------------------------------------ clients

    def _dispatch_client(self, peer: bytes, env: Envelope, frames: list[Any]) -> Any:
        body = env.body
        if isinstance(body, m.Hello):
            return self._hello(peer, body, frames)
        if isinstance(body, m.DiscoverWorkerEndpoint):
            return _ready(m.WorkerEndpoint(int(self.workers.address.rsplit(":", 1)[1])))
        caller = self.callers.get(peer)
        if caller is None or caller.connection_key != self._connection_key(frames):
            raise ReconnectRequired("this coordinator does not know this connection (it restarted, or the "
                                    "connection never said Hello): say Hello again, resuming the session")
        if isinstance(body, m.REQUEST_TYPES):
            return self.front_door.submit(peer, body, caller.owner, [f.bytes for f in frames])
        if isinstance(body, m.SessionHeartbeat):
            if self.keys is not None and not self.keys.is_active(caller.owner):
                self._forget(peer)
                raise AuthenticationError("this session's API key was revoked")
            if not self.front_door.heartbeat(body.session_id, caller.owner):
                raise NotFoundError(f"session {body.session_id} is closed or unknown")
            return _ready(m.Ack())
        if isinstance(body, m.CloseSession):
            self.front_door.close_session(body.session_id, caller.owner)
            self._forget(peer)
            return _ready(m.Ack())
        if self.front_door.is_query(body):
            return self.front_door.query(body, caller.owner)
        if isinstance(body, m.Ping):
            return self._ping(body)
        raise BadRequestError(f"the coordinator does not take {type(body).__name__} from clients", field="kind")

    def _hello(self, peer: bytes, hello: m.Hello, frames: list[Any]) -> asyncio.Future[Any]:
        if hello.protocol != m.PROTOCOL_VERSION:
            raise BadRequestError(
                f"client speaks protocol {hello.protocol}, this coordinator speaks {m.PROTOCOL_VERSION}; "
                "upgrade the older side",
                field="protocol",
            )
        caller = Caller(self.authenticate(hello.api_key), self._connection_key(frames))
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
        return _ready(m.Welcome(session_id, __version__, self.config.cycle_s))

    def authenticate(self, api_key: str | None) -> str:
        """The owner an API key stands for (its key id); AuthenticationError if it is missing, wrong or revoked.

        Without keys (`bios keys init` never ran for this state dir, so the coordinator listens on loopback
        only) every caller is `LOCAL_OWNER`. The HTTP gateway calls this with each request's X-API-Key.
        """
        if self.keys is None:
            return LOCAL_OWNER
        return self.keys.authenticate(api_key)

    @property
    def keys_required(self) -> bool:
        """True once `bios keys init` ran for the state dir: every front end must then check keys."""
        return self.keys is not None

    def _connection_key(self, frames: list[Any]) -> str | None:
        """The CurveZMQ public key the message came from (set by the ZAP handler); None without keys."""
        return None if self.keys is None else frames[0].get("User-Id")

    def _forget(self, peer: bytes) -> None:
        self.sessions.pop(peer, None)
        self.callers.pop(peer, None)

    async def _ping(self, ping: m.Ping) -> m.Pong:
        members = self.membership.alive()
        if not members:
            raise RequestFailedError("no worker is connected to this coordinator")
        reply = await self._ask_worker(members[0].peer, ping, timeout=self.config.heartbeat_timeout_s)
        return reply

    async def _status(self) -> m.ClusterStatus:
        return m.ClusterStatus(
            cycles_run=self.runner.cycles_run,
            cycle_s=self.config.cycle_s,
            generation=self.membership.generation,
            workers=self.membership.status(active=self.runner.holders, parked=self.runner.parked,
                                           placed=self.runner.placed),
            queue_depth=await self.scheduler.ask(QueueDepth()),
            runs=len(self.store.list_runs()),
            busy_s=self.runner.busy_s,
            uptime_s=time.monotonic() - self._started,
            phase_seconds=dict(self.runner.phase_seconds),
            plans=await self.scheduler.ask(PlanDescriptions()),
            state_dir=self.store.disk.space(),
            groups=self.runner.group_status(),
            placement_notes=list(self.runner.placement.reasons),
        )

    async def refresh_metrics(self) -> None:
        """Bring the state gauges (workers, queues, busy fraction) up to date before a scrape."""
        self.metrics.observe_status(await self._status(), await self.scheduler.ask(QueueDepth(by_pool=True)))

    def _keys(self) -> list[KeyInfo]:
        return [] if self.keys is None else self.keys.list()

    def _capabilities(self) -> t.GetServerCapabilitiesResponse:
        names = sorted({name for member in self.membership.alive() for name in member.models})
        return t.GetServerCapabilitiesResponse([t.SupportedModel(model_name=name) for name in names],
                                               cycle_s=self.config.cycle_s)

    async def _push(self, peer: bytes, frames: list[Any]) -> None:
        local = self._local_clients.get(peer)
        if local is not None:
            local(self.codec.decode(frames).body)
        else:
            await self.clients.send_raw(peer, frames)

    # ------------------------------------------------------------------------------------ in-process clients

    def attach_local_client(self, name: str, on_done: Callable[[m.RequestDone], None]) -> bytes:
        """Register an in-process front end (the HTTP gateway); its results come to `on_done`."""
        peer = f"local:{name}".encode()
        self._local_clients[peer] = on_done
        return peer

    # ------------------------------------------------------------------------------------ workers

    def _dispatch_worker(self, peer: bytes, env: Envelope, frames: list[Any]) -> Any:
        body = env.body
        if env.reply_to is not None and env.reply_to in self._worker_asks:
            future = self._worker_asks.pop(env.reply_to)
            if not future.done():
                future.set_result(body)
            return None
        if isinstance(body, m.RegisterWorker):
            if self.keys is not None:
                self.keys.check_worker_token(body.token)
            self.membership.register(peer, body)
            return _ready(m.WorkerAccepted(self.config.worker_heartbeat_s))
        worker_id = self._worker_id(peer)
        if worker_id is None:
            log.info("a message from a worker that is not a member (%s): asking it to register again",
                     type(body).__name__)
            return asyncio.ensure_future(self._send_to_worker(peer, m.Rejoin(
                "this worker is not a member of the cluster (it was declared dead or never registered)")))
        if isinstance(body, m.WorkerHeartbeat):
            self.membership.heartbeat(worker_id, peer)
        elif isinstance(body, m.ItemDone):
            self.runner.item_done(worker_id, body)
        elif isinstance(body, m.SampleProgress):
            self.runner.sample_progress(worker_id, body)
        elif isinstance(body, m.CycleDone):
            self.runner.worker_done(worker_id, body)
        elif isinstance(body, m.Reconfigured):
            self.runner.reconfigured(worker_id, body)
        elif isinstance(body, m.Leaving):
            member = self.membership.mark_leaving(worker_id, body.reason)
            if member is not None:
                self.runner.leaving(member)
        elif isinstance(body, m.Shutdown):
            self.membership.mark_dead(worker_id, f"left: {body.reason}")
            self._lost(worker_id)
        else:
            raise BadRequestError(f"the coordinator does not take {type(body).__name__} from workers", field="kind")
        return None

    def _worker_id(self, peer: bytes) -> str | None:
        for member in self.membership.members.values():
            if member.peer == peer and member.state != "dead":
                return member.worker_id
        return None

    def _lost(self, worker_id: str) -> None:
        member = self.membership.members.get(worker_id)
        if member is not None:
            self.runner.worker_lost(member)

    async def _send_to_worker(self, peer: bytes, body: Any) -> None:
        await self.workers.send(peer, Envelope(next_message_id(), body))

    async def _ask_worker(self, peer: bytes, body: Any, timeout: float) -> Any:
        env_id = next_message_id()
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._worker_asks[env_id] = future
        try:
            await self.workers.send(peer, Envelope(env_id, body))
            async with asyncio.timeout(timeout):
                return await future
        finally:
            self._worker_asks.pop(env_id, None)

    def _load_state(self, path: str) -> m.CheckpointState:
        """A checkpoint's tensors, for the workers (sampler weights, restores): any owner's, by its path."""
        return self.catalog.load(path, None)

    def _latest_checkpoint(self, run_id: str) -> str | None:
        record = self.catalog.latest_automatic(run_id)
        return None if record is None else record.path

    async def _probe(self, member: Any) -> bool:
        try:
            await self._ask_worker(member.peer, m.Ping(), timeout=PROBE_TIMEOUT_S)
        except (asyncio.TimeoutError, TimeoutError):
            return False
        return True



def _ready(value: Any) -> asyncio.Future[Any]:
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future
