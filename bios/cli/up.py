"""`bios up` (a coordinator and N workers on this machine), `bios down` (stop it gracefully), `bios logs`.

`bios up` runs the cluster in the foreground, or with `--detach` in a background `bios up` whose output goes to
`<state-dir>/bios-up.log`. Either way it records itself in `<state-dir>/bios-up.json` (`up_record`), which is how
`bios down` finds it; every daemon writes its log into the state dir, which is where `bios logs` reads them.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from bios import cluster_defaults
from bios.cli.support import (
    USAGE_EXIT,
    CommandError,
    HelpFormatter,
    add_checkpoint_options,
    add_state_dir,
    parse_size,
)
from bios.sdk.local_cluster import LocalCluster
from bios.security.keys import KeyStore

from .up_record import RECORD_NAME, UpRecord, read_record, remove_record, write_record

STOP_GRACE_S = 60.0  # how long workers may take to finish the cycle in progress when the cluster stops
START_TIMEOUT_S = 120.0
UP_LOG = "bios-up.log"


def add_up_parsers(subparsers: argparse._SubParsersAction) -> None:
    up = subparsers.add_parser(
        "up", formatter_class=HelpFormatter,
        help="run a coordinator and N workers on this machine (Ctrl-C or `bios down` stops them)",
        description="Run a coordinator and N workers on this machine. Workers on other hosts join with "
                    "`bios-worker --coordinator tcp://THIS_HOST:PORT --token ...`: see docs/run-a-cluster.md.")
    up.add_argument("--workers", type=int, default=1, help="worker processes to start here")
    up.add_argument("--listen", default="tcp://127.0.0.1:7600",
                    help="where clients connect (port 0 picks a free one); any address but loopback needs keys "
                         "(bios keys init)")
    up.add_argument("--http", metavar="HOST:PORT",
                    help="also serve the Tinker-compatible HTTP API, e.g. 127.0.0.1:8000 (default: off)")
    up.add_argument("--metrics", metavar="HOST:PORT",
                    help="serve Prometheus metrics at http://HOST:PORT/metrics (default: off)")
    add_state_dir(up, "store, keys, checkpoints and logs")
    up.add_argument("--cycle-s", type=float, default=0.0,
                    help="seconds between cycles; 0 runs them back to back (bios-coordinator's default is 10)")
    up.add_argument("--heartbeat-timeout", type=float, default=5.0, help="seconds before a silent worker is dead")
    up.add_argument("--collective-timeout", type=float, default=None,
                    help="seconds a worker's collective may wait for a busier peer (default: "
                         f"{cluster_defaults.COLLECTIVE_TIMEOUT_S:g}, as bios-coordinator)")
    add_checkpoint_options(up)
    up.add_argument("--memory-limit", type=parse_size, metavar="SIZE",
                    help="each worker's memory budget instead of its device's (e.g. 2GiB); a model that does not "
                         "fit is split over several workers")
    up.add_argument("--worker-threads", type=int, help="torch CPU threads per worker (default: the usable cores "
                    "divided evenly among the workers, at least 1)")
    up.add_argument("--model-map", metavar="FILE",
                    help="JSON map of model names (e.g. Qwen/Qwen3-8B-Base) to local model directories")
    up.add_argument("--log-level", default=os.environ.get("BIOS_LOG_LEVEL", "INFO"),
                    help="DEBUG logs every request ($BIOS_LOG_LEVEL)")
    up.add_argument("--log-format", choices=("text", "json"), default=os.environ.get("BIOS_LOG_FORMAT", "text"),
                    help="the coordinator's log; json: one object per line with run and request ids "
                         "($BIOS_LOG_FORMAT)")
    up.add_argument("-d", "--detach", action="store_true",
                    help=f"start in the background and return (output in STATE_DIR/{UP_LOG}); stop with bios down")
    up.set_defaults(func=run_up)

    down = subparsers.add_parser("down", formatter_class=HelpFormatter,
                                 help="stop the cluster `bios up` runs; workers finish the cycle in progress")
    add_state_dir(down, "the state dir `bios up` ran with")
    down.add_argument("--timeout", type=float, default=STOP_GRACE_S + 15, help="seconds to wait for it to stop")
    down.set_defaults(func=run_down)

    logs = subparsers.add_parser("logs", formatter_class=HelpFormatter,
                                 help="print or follow the log of the coordinator or a worker that `bios up` runs")
    logs.add_argument("process", nargs="?", choices=("coordinator", "worker"), default="coordinator")
    logs.add_argument("index", nargs="?", type=int, help="which worker: `bios logs worker 1` (default: 0)")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until Ctrl-C")
    logs.add_argument("-n", "--tail", type=int, metavar="N", help="only the last N lines (default: all)")
    add_state_dir(logs, "the state dir `bios up` runs with")
    logs.set_defaults(func=run_logs)


# ---------------------------------------------------------------------------------------------------- up


def run_up(args: argparse.Namespace) -> int:
    running = read_record(args.state_dir)
    if running is not None:
        raise CommandError(f"a cluster already runs from {args.state_dir} (pid {running.pid}, clients at "
                           f"{running.address}): stop it with `bios down --state-dir {args.state_dir}`, or give "
                           "this one another --state-dir")
    if args.detach:
        return _detach(args)
    env = {"BIOS_MODEL_MAP": os.path.abspath(args.model_map)} if args.model_map else None
    cluster = LocalCluster(
        workers=args.workers, listen=args.listen, cycle_s=args.cycle_s, state_dir=args.state_dir,
        heartbeat_timeout_s=args.heartbeat_timeout, collective_timeout_s=args.collective_timeout,
        worker_threads=args.worker_threads, http=args.http,
        metrics=args.metrics, checkpoint_every=args.checkpoint_every, keep_checkpoints=args.keep_checkpoints,
        log_level=args.log_level, log_format=args.log_format, env=env, worker_memory_limit=args.memory_limit,
    )
    stop = _stop_on_signals()
    try:
        cluster.start()  # a coordinator that cannot start raises ClusterStartError, naming its reason and log
    except BaseException:
        cluster.stop()
        raise
    try:
        record = write_record(args.state_dir, address=cluster.address, http=cluster.http_url,
                              metrics=cluster.metrics_url, logs=_log_files(cluster))
        print(banner(record, args), flush=True)
        _watch(cluster, stop)
    finally:
        print("stopping: workers finish the cycle in progress", flush=True)
        cluster.stop(timeout_s=STOP_GRACE_S)
        remove_record(args.state_dir)
    return 0


def _stop_on_signals() -> list[int]:
    """SIGTERM/SIGINT end `bios up`'s wait; the returned list fills with the signal received."""
    received: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: received.append(signum))
    return received


def _watch(cluster: LocalCluster, stop: list[int]) -> None:
    """Wait for a signal; say when a worker exits, and stop with the coordinator's reason if it exits."""
    reported: set[int] = set()
    assert cluster.coordinator is not None
    while not stop:
        if cluster.coordinator.poll() is not None:
            raise CommandError(f"the coordinator exited (code {cluster.coordinator.returncode}): "
                               f"{cluster.last_error('coordinator')} (log: {cluster.log_path('coordinator')})")
        for i, worker in enumerate(cluster.workers):
            if i not in reported and worker.poll() is not None:
                reported.add(i)
                print(f"worker {i} exited (code {worker.returncode}): {cluster.last_error(f'worker-{i}')} "
                      f"(bios logs worker {i})", flush=True)
        time.sleep(0.2)


def _log_files(cluster: LocalCluster) -> dict[str, str]:
    names = ["coordinator", *(f"worker-{i}" for i in range(len(cluster.workers)))]
    return {name: str(cluster.log_path(name)) for name in names}


def banner(record: UpRecord, args: argparse.Namespace) -> str:
    """Where everything is: addresses, keys, logs, and how to stop."""
    keys = KeyStore.open(args.state_dir)
    if keys is not None:
        keys.close()
    cycles = "back to back" if args.cycle_s == 0 else f"every {args.cycle_s:g}s"
    lines = [
        f"bios cluster up (pid {record.pid}): {args.workers} worker(s), cycles {cycles}, state in {args.state_dir}",
        f"  native SDK   {record.address}   ServiceClient(address=...) or BIOS_ADDRESS",
    ]
    if record.http:
        lines.append(f"  Tinker SDK   {record.http}   tinker.ServiceClient(base_url=...)")
        lines.append(f"  OpenAI API   {record.http}/v1   openai.OpenAI(base_url=..., api_key=...)")
        lines.append(f"  console      {record.http}/")
    if record.metrics:
        lines.append(f"  metrics      {record.metrics}")
    lines.append("  API keys     " + (f"required: bios keys create NAME --state-dir {args.state_dir}" if keys else
                                      "off (bios keys init turns them on; needed beyond loopback)"))
    lines.append(f"  logs         {Path(args.state_dir) / 'coordinator.log'}, "
                 f"{Path(args.state_dir) / 'worker-N.log'}: bios logs [coordinator|worker N] [-f]")
    lines.append(f"  stop         {'' if args.detach else 'Ctrl-C, or '}bios down --state-dir {args.state_dir}")
    return "\n".join(lines)


def _detach(args: argparse.Namespace) -> int:
    """Run `bios up` (without --detach) in a new session and return once its cluster serves."""
    args.state_dir.mkdir(parents=True, exist_ok=True)
    log_path = args.state_dir / UP_LOG
    offset = log_path.stat().st_size if log_path.exists() else 0
    argv = [a for a in args.argv if a not in ("-d", "--detach")]
    with open(log_path, "ab") as log_file:
        child = subprocess.Popen([sys.executable, "-m", "bios.cli", *argv], stdin=subprocess.DEVNULL,
                                 stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while (record := read_record(args.state_dir)) is None or record.pid != child.pid:
        if child.poll() is not None:
            with open(log_path, "rb") as log_file:
                log_file.seek(offset)
                said = [line for line in log_file.read().decode(errors="replace").splitlines() if line.strip()]
            reason = said[-1].removeprefix("bios: error: ") if said else f"exit code {child.returncode}"
            raise CommandError(f"the cluster did not start: {reason} (log: {log_path})")
        if time.monotonic() > deadline:
            child.terminate()
            raise CommandError(f"the cluster did not start within {START_TIMEOUT_S:.0f}s (log: {log_path})")
        time.sleep(0.1)
    print(banner(record, args))
    return 0


# ---------------------------------------------------------------------------------------------------- down


def run_down(args: argparse.Namespace) -> int:
    record = read_record(args.state_dir)
    if record is None:
        raise CommandError(f"no cluster runs from {args.state_dir} ({RECORD_NAME} is absent or its process is "
                           "gone): pass the --state-dir that `bios up` used")
    os.kill(record.pid, signal.SIGTERM)
    try:
        psutil.Process(record.pid).wait(args.timeout)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        raise CommandError(f"the cluster (pid {record.pid}) is still stopping after {args.timeout:g}s, its workers "
                           f"finishing a long cycle: wait, or end it now with `kill -9 {record.pid}`") from None
    print(f"stopped the cluster at {record.address} (pid {record.pid})")
    return 0


# ---------------------------------------------------------------------------------------------------- logs


def run_logs(args: argparse.Namespace) -> int:
    if args.process == "coordinator" and args.index is not None:
        raise CommandError("the coordinator has no number: `bios logs coordinator` or `bios logs worker N`",
                           exit_code=USAGE_EXIT)
    name = "coordinator" if args.process == "coordinator" else f"worker-{args.index or 0}"
    path = args.state_dir / f"{name}.log"
    if not path.is_file():
        present = sorted(p.stem for p in args.state_dir.glob("*.log") if p.name != UP_LOG)
        raise CommandError(f"no {name} log in {args.state_dir}" + (
            f"; there are: {', '.join(present)}" if present else
            ": `bios logs` reads the logs of a cluster started with `bios up --state-dir` that directory"))
    if args.follow:  # Ctrl-C stops following even where the caller started it ignoring SIGINT (a background job)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _print_log(path, args.tail, args.follow)
    except KeyboardInterrupt:  # how one stops following
        pass
    return 0


def _print_log(path: Path, tail: int | None, follow: bool) -> None:
    with open(path, "rb") as log_file:
        lines = log_file.read().splitlines(keepends=True)
        sys.stdout.buffer.write(b"".join(lines[-tail:] if tail else lines))
        sys.stdout.flush()
        while follow:
            more = log_file.read()
            if more:
                sys.stdout.buffer.write(more)
                sys.stdout.flush()
            else:
                time.sleep(0.2)
