"""`bios up` (a local cluster in the foreground) and `bios status` (what a cluster is doing)."""

from __future__ import annotations

import argparse
import os
import signal
import time

from .local_cluster import LocalCluster
from .service import ServiceClient


def add_cluster_parsers(subparsers: argparse._SubParsersAction) -> None:
    up = subparsers.add_parser("up", help="run a coordinator and N workers on this machine until Ctrl-C")
    up.add_argument("--workers", type=int, default=1)
    up.add_argument("--listen", default="tcp://127.0.0.1:7600")
    up.add_argument("--cycle-s", type=float, default=0.0, help="seconds between cycles (0 = back-to-back)")
    up.add_argument("--state-dir", default="bios-state")
    up.add_argument("--worker-threads", type=int, default=None)
    up.set_defaults(func=run_up)

    status = subparsers.add_parser("status", help="workers, generation, queue depth and cycles of a cluster")
    status.add_argument("--address", default=os.environ.get("BIOS_ADDRESS", "tcp://127.0.0.1:7600"))
    status.add_argument("--api-key", default=os.environ.get("BIOS_API_KEY"))
    status.set_defaults(func=run_status)


def run_up(args: argparse.Namespace) -> int:
    cluster = LocalCluster(workers=args.workers, listen=args.listen, cycle_s=args.cycle_s,
                           state_dir=args.state_dir, worker_threads=args.worker_threads)
    cluster.start()
    print(f"bios cluster up: clients connect to {cluster.address} ({args.workers} worker(s), "
          f"state in {args.state_dir}); Ctrl-C stops it", flush=True)
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        while not stop and cluster.coordinator is not None and cluster.coordinator.poll() is None:
            time.sleep(0.2)
    finally:
        cluster.stop()
    return 0


def run_status(args: argparse.Namespace) -> int:
    with ServiceClient(address=args.address, api_key=args.api_key, connect_timeout_s=5) as client:
        status = client.cluster_status()
    busy = status.busy_s / status.uptime_s if status.uptime_s else 0.0
    print(f"coordinator {args.address}: generation {status.generation}, {status.runs} run(s), "
          f"{status.queue_depth} queued request(s)")
    print(f"cycles: {status.cycles_run} run, cycle_s={status.cycle_s:g}, busy {busy:.0%} of {status.uptime_s:.0f}s")
    print(f"{'worker':<28} {'state':<8} {'device':<8} {'pid':>7}  host  heartbeat")
    for w in status.workers:
        print(f"{w.worker_id:<28} {w.state:<8} {w.device:<8} {w.pid:>7}  {w.host}  {w.last_heartbeat_age_s:.1f}s ago")
    return 0
