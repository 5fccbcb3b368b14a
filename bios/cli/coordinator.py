"""`bios-coordinator`: run the coordinator daemon until SIGTERM/SIGINT, then stop its workers and exit."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import zmq

from bios import cluster_defaults
from bios.actors import loop as event_loop
from bios.cli.support import HelpFormatter, add_checkpoint_options, add_state_dir
from bios.security.keys import KeyStore
from bios.security.limits import Quotas
from bios.security.listen import InsecureListenError, check_http

from bios.coordinator.config import CoordinatorConfig
from bios.coordinator.metrics import JsonLogFormatter, serve_metrics
from bios.coordinator.server import Coordinator

log = logging.getLogger(__name__)


class PortInUseError(RuntimeError):
    """An address this coordinator should listen on is taken; the message names the option to change."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bios-coordinator", description="Run the Bios coordinator daemon.",
                                formatter_class=HelpFormatter)
    p.add_argument("--listen", default="tcp://127.0.0.1:7600", help="client address (port 0 picks a free one)")
    p.add_argument("--worker-port", type=int, default=None, help="worker port (default: the client port + 1)")
    add_state_dir(p, "SQLite store, keys and checkpoints")
    p.add_argument("--cycle-s", type=float, default=10.0, help="seconds between cycles; 0 = back-to-back")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0, help="seconds before a silent worker is dead")
    p.add_argument("--collective-timeout", type=float, default=cluster_defaults.COLLECTIVE_TIMEOUT_S,
                   help="seconds a worker's collective may wait for a peer that is alive but busier (one long row): "
                        "a pass that keeps one worker busy longer than this beyond its peers fails its request")
    p.add_argument("--seq-gap", type=float, default=float(os.environ.get("BIOS_SEQ_GAP_S", 120.0)),
                   help="seconds a run's requests wait for a seq_id that never came before they are withdrawn "
                        "(their clients are told to resend it)")
    add_checkpoint_options(p)
    p.add_argument("--http", default=None, metavar="HOST:PORT",
                   help="also serve the Tinker-compatible HTTP API, the web console and /v1 here (port 0 picks a free "
                        "one; default: off); beyond loopback only with keys (bios keys init)")
    p.add_argument("--metrics", default=None, metavar="HOST:PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (port 0 picks a free one; default: off); "
                        "aggregate counters, served without a key")
    p.add_argument("--ready-file", type=Path, default=None, help="write the bound addresses here as JSON")
    p.add_argument("--log-level", default=os.environ.get("BIOS_LOG_LEVEL", "INFO"),
                   help="DEBUG logs every request ($BIOS_LOG_LEVEL)")
    p.add_argument("--log-format", choices=("text", "json"), default=os.environ.get("BIOS_LOG_FORMAT", "text"),
                   help="json: one object per line, with run_id/request_id fields where a line has them")
    return p.parse_args(argv)


async def run(args: argparse.Namespace) -> None:
    config = CoordinatorConfig(
        listen=args.listen,
        worker_port=args.worker_port,
        state_dir=args.state_dir,
        cycle_s=args.cycle_s,
        heartbeat_timeout_s=args.heartbeat_timeout,
        collective_timeout_s=args.collective_timeout,
        # Workers heartbeat often enough that a short timeout still spans several heartbeats.
        worker_heartbeat_s=min(CoordinatorConfig.worker_heartbeat_s, args.heartbeat_timeout / 4),
        seq_gap_s=args.seq_gap,
        checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints,
        quotas=Quotas.from_env(),
    )
    if args.http:  # before anything binds: a refused --http starts nothing (--listen is checked by Coordinator)
        check_http(args.http, keys=KeyStore.path_in(args.state_dir).exists())
    coordinator = Coordinator(config)
    with _binding("--listen", args.listen):
        addresses = await coordinator.start()
    log.info("cycle length %gs (--cycle-s): %s", args.cycle_s,
             "cycles run back to back" if args.cycle_s == 0 else
             "a request accepted between two ticks waits for the next one; --cycle-s 0 runs cycles back to back")
    gateway = metrics = None
    try:
        if args.http:
            # The process entry point composes the layers: the gateway sits above the coordinator.
            from bios.gateway.server import start_gateway

            with _binding("--http", args.http):
                gateway = await start_gateway(coordinator.front_door, coordinator.accounts, args.http)
        if args.metrics:
            with _binding("--metrics", args.metrics):
                metrics = await serve_metrics(coordinator.metrics, args.metrics, coordinator.refresh_metrics)
        if args.ready_file is not None:
            ready = {"clients": addresses.clients, "workers": addresses.workers, "pid": os.getpid(),
                     "http": gateway.url if gateway is not None else None,
                     "metrics": metrics.url if metrics is not None else None}
            tmp = args.ready_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(ready))
            tmp.replace(args.ready_file)
        await _serve(coordinator)
    finally:
        log.info("coordinator stopping")
        if gateway is not None:
            await gateway.stop()
        if metrics is not None:
            await metrics.stop()
        await coordinator.stop()


async def _serve(coordinator: Coordinator) -> None:
    """Until SIGTERM/SIGINT, or until the coordinator fails (then raise its error)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    serving = loop.create_task(coordinator.wait())
    stopping = loop.create_task(stop.wait())
    await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if serving.done() and not serving.cancelled() and serving.exception() is not None:
        raise serving.exception()  # type: ignore[misc]


@contextlib.contextmanager
def _binding(option: str, address: str) -> Iterator[None]:
    """Turn "address already in use" (ZeroMQ's or asyncio's) into one line naming the option to change."""
    try:
        yield
    except (OSError, zmq.ZMQError) as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        raise PortInUseError(f"cannot listen on {address} ({option}): the port is in use, by another Bios "
                             f"cluster or another program; choose a free one with {option}, or stop the other "
                             "(bios down)") from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter("coordinator") if args.log_format == "json" else
                         logging.Formatter("%(asctime)s coordinator %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    try:
        event_loop.run(run(args))
    except (InsecureListenError, PortInUseError) as exc:
        log.error("%s", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
