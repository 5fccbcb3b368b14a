"""The coordinator process as one assembly: the two endpoints (`client_endpoint`, `worker_endpoint`), the
scheduler actor, the groups' cycle runners and the watchdog, built and wired here and nowhere else."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import zmq
import zmq.asyncio

from bios import wire
from bios.actors.actor import ActorRef, Policy, spawn
from bios.actors.remote import serve
from bios.security.keys import KeyStore
from bios.security.limits import QuotaLedger
from bios.security.listen import check_listen
from bios.security.zap import CLIENT_DOMAIN, WORKER_DOMAIN, ZapHandler
from bios.transport.codec import Limits
from bios.transport.sockets import Router

from .accounts import Accounts
from .audit import AuditLog
from .catalog import Catalog
from .checkpoints import DirectoryCheckpointStore
from .client_endpoint import ClientEndpoint
from .clock import CycleClock
from .config import REJOIN_GRACE_HEARTBEATS, Addresses, CoordinatorConfig
from .cycles import CycleRunner
from .front_door import FrontDoor
from .generations import GenerationFormer
from .groups import Groups
from .labels import Labels
from .membership import Membership
from .metrics import CoordinatorMetrics
from .queries import Queries
from .roster import Roster
from .scheduler import Scheduler, SchedulerConfig
from .status import ClusterView
from .store import Store
from .usage import Usage
from .watchdog import Watchdog
from .worker_endpoint import WorkerEndpoint

log = logging.getLogger(__name__)

class Coordinator:
    """The coordinator process as one assembly: it builds the parts, wires them, and starts and stops them."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.keys = KeyStore.open(config.state_dir)
        check_listen(config.listen, keys=self.keys is not None)
        self.ctx = zmq.asyncio.Context()
        self.codec = wire.make_codec()
        client_codec = wire.make_codec(Limits(max_message_bytes=config.quotas.max_message_bytes))
        self.zap: ZapHandler | None = None
        security = None
        if self.keys is not None:  # CurveZMQ on both sockets; the ZAP handler admits only token holders as workers
            security = self.keys.cluster.server_security()
            self.zap = ZapHandler(self.ctx, self.keys.cluster.worker_token().curve_public_key())
        # Both sockets get a ZAP domain even without keys: a domain without a handler admits everyone, but makes
        # libzmq hang up at once on a peer that is not ZeroMQ 3 (an HTTP client such as the Tinker SDK at the
        # wrong port), as with keys.
        clients = Router(self.ctx, client_codec, security=security, zap_domain=CLIENT_DOMAIN)
        workers = Router(self.ctx, self.codec, security=security, zap_domain=WORKER_DOMAIN)
        self.ledger = QuotaLedger(config.quotas)
        self.store = Store(config.state_dir)
        self.catalog = Catalog(self.store, DirectoryCheckpointStore(config.state_dir / "checkpoints"))
        self.usage = Usage(self.store)  # per-key accounting and the audit log start with the state dir
        self.accounts = Accounts(self.keys, Labels(self.store), AuditLog(self.store.db), self.store, self.catalog)
        self.membership = Membership(config.heartbeat_timeout_s)
        self.metrics = CoordinatorMetrics()
        self.workers = WorkerEndpoint(workers, self.membership, self.keys, config.worker_heartbeat_s)
        self.clients = ClientEndpoint(clients, self.accounts, config.cycle_s,
                                      lambda: int(workers.address.rsplit(":", 1)[1]), self.workers.ping_any)
        self._tasks: list[asyncio.Task[Any]] = []
        self._started = time.monotonic()
        self.scheduler: ActorRef
        self.runner: Groups
        self.view: ClusterView
        self.front_door: FrontDoor

    async def start(self) -> Addresses:
        if self.zap is not None:
            self.zap.start()
        clients = self.clients.router.bind(self.config.listen)
        host, client_port = clients.rsplit(":", 1)
        worker_port = self.config.worker_port
        if worker_port is None:
            worker_port = 0 if self.config.listen.endswith(":0") else int(client_port) + 1
        workers = self.workers.router.bind(f"{host}:{worker_port}")
        scheduling = SchedulerConfig(self.config.checkpoint_every, self.config.keep_checkpoints)
        self.scheduler = spawn(
            lambda: Scheduler(self.store, self.catalog, self.codec, self.clients.push,
                              lambda: self.runner.work_queued(), scheduling, self.ledger, self.metrics,
                              workers=self.membership.alive),
            name="scheduler",
            policy=Policy.RESUME,
        )
        queries = Queries(self.store, self.catalog, self.keys.list if self.keys is not None else list)
        self.runner = self.workers.groups = Groups(self.scheduler, self.membership, self._make_runner,
                                                   self.config.cycle_s, self.workers.send)
        self.view = ClusterView(self.membership, self.runner, self.scheduler, self.store, self.config.cycle_s)
        self.front_door = self.clients.front_door = FrontDoor(self.store, self.scheduler, queries, self.ledger,
                                                              self.codec, self.view.capabilities, self.view.status)
        watchdog = Watchdog(self.membership, self.runner, self.scheduler, self.front_door,
                            heartbeat_timeout_s=self.config.heartbeat_timeout_s,
                            session_timeout_s=self.config.session_timeout_s,
                            stalled_after_s=self.config.stalled_after_s, seq_gap_s=self.config.seq_gap_s)
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(serve(self.clients.router, self.clients.dispatch), name="clients"),
            loop.create_task(serve(self.workers.router, self.workers.dispatch), name="workers"),
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
            group_id, self.scheduler, self.membership, roster, self.workers.send, self.catalog.load_for_workers,
            self.catalog.latest_automatic_path, self.workers.probe,
            join_timeout_s=self.config.heartbeat_timeout_s,
            epoch=epoch,
            collective_timeout_s=self.config.collective_timeout_s,
            committed=self.store.committed(),
            rejoin_grace_s=max(0.0, self._started + REJOIN_GRACE_HEARTBEATS * self.config.heartbeat_timeout_s
                               - time.monotonic()),  # only the groups formed right after a restart wait
        )
        return CycleRunner(group_id, self.scheduler, clock, self.membership, roster, generations,
                           self.workers.send, self.catalog.load_for_workers, self.workers.probe, self.metrics)

    async def wait(self) -> None:
        """Run until a serving task fails (which is a bug: it is logged and re-raised)."""
        done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()

    async def stop(self) -> None:
        """Tell every worker to exit, then close."""
        await self.workers.shutdown_all("coordinator stopping")
        await asyncio.sleep(0.05)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.scheduler.stop()
        self.close_sockets()
        if self.zap is not None:
            await self.zap.stop()
        if self.keys is not None:
            self.keys.close()
        self.store.close()
        self.ctx.term()

    def close_sockets(self) -> None:
        self.clients.router.close()
        self.workers.router.close()

    async def refresh_metrics(self) -> None:
        """Bring the state gauges (workers, queues, busy fraction) up to date before a scrape."""
        self.metrics.observe_status(await self.view.status(), await self.scheduler.ask(Scheduler.queue_depths))
