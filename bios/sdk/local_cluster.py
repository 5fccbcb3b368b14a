"""A coordinator and its workers as child processes on loopback: the embedded cluster.

`ServiceClient()` with no address starts one (one worker, back-to-back cycles, a fresh state dir) and stops it
on close or at exit. Children die with their parent even when it is killed (Linux parent-death signal), so a
crashed user script leaves no orphans.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

from bios import exceptions
from bios.cpu_cores import threads_per_worker
from bios.security.keys import KeyStore

_PR_SET_PDEATHSIG = 1
# "2026-01-01 12:00:00,000 coordinator ERROR bios.cli.coordinator: message", as the daemons log in text
_TEXT_LOG = re.compile(r"^\S+ \S+ \S+ [A-Z]+ \S+: (.*)$")


class ClusterStartError(exceptions.APIConnectionError):
    """The coordinator exited while starting; the message names the reason its log gives and the log file."""


def _die_with_parent() -> None:
    """preexec_fn: ask the kernel to SIGTERM this child when its parent exits."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class LocalCluster:
    """`bios up` and the embedded mode: a coordinator plus `workers` worker processes on 127.0.0.1."""

    def __init__(
        self,
        *,
        workers: int = 1,
        cycle_s: float = 0.0,
        state_dir: str | Path | None = None,
        heartbeat_timeout_s: float = 5.0,
        worker_threads: int | None = None,
        listen: str = "tcp://127.0.0.1:0",
        log_level: str = "INFO",
        http: str | None = None,
        metrics: str | None = None,
        checkpoint_every: int = 0,
        keep_checkpoints: int = 2,
        log_format: str = "text",
        env: dict[str, str] | None = None,
        start_timeout_s: float = 120.0,
        worker_memory_limit: str | int | None = None,
        collective_timeout_s: float | None = None,
    ) -> None:
        self._owns_state_dir = state_dir is None
        self.state_dir = Path(state_dir) if state_dir is not None else Path(tempfile.mkdtemp(prefix="bios-"))
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.num_workers = workers
        self.cycle_s = cycle_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.collective_timeout_s = collective_timeout_s  # None: the coordinator's default
        self.worker_threads = worker_threads
        self.listen = listen
        self.log_level = log_level
        self.http = http
        self.checkpoint_every = checkpoint_every
        self.keep_checkpoints = keep_checkpoints
        self.log_format = log_format  # the coordinator's log: "text" or "json"
        self.http_url: str | None = None
        self.metrics = metrics
        self.metrics_url: str | None = None  # http://HOST:PORT/metrics once started with `metrics`
        self.env = {**os.environ, **(env or {})}
        self.start_timeout_s = start_timeout_s
        self.worker_memory_limit = worker_memory_limit  # bios-worker --memory-limit for every worker
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.workers: list[subprocess.Popen[bytes]] = []
        self.address = ""
        self._addresses: dict[str, str] = {}

    # ------------------------------------------------------------------------------------ lifecycle

    def start(self) -> LocalCluster:
        addresses = self._start_coordinator(self.listen)
        self.address = addresses["clients"]
        self.http_url = addresses.get("http")
        self.metrics_url = addresses.get("metrics")
        for _ in range(self.num_workers):
            self.add_worker()
        return self

    def restart_coordinator(self) -> None:
        """SIGKILL the coordinator and start a new one on the same addresses and state dir, as an operator's
        supervisor would; the workers and clients carry on with it."""
        assert self.coordinator is not None, "start the cluster first"
        self.coordinator.kill()
        self.coordinator.wait()
        self.start_coordinator_again()

    def start_coordinator_again(self) -> None:
        """Start a coordinator on the addresses and state dir of the last one (which must be gone)."""
        workers_port = int(self._addresses["workers"].rsplit(":", 1)[1])
        http = self.http_url.removeprefix("http://") if self.http_url else None
        self._start_coordinator(self.address, workers_port, http)

    def _start_coordinator(self, listen: str, worker_port: int | None = None,
                           http: str | None = None) -> dict[str, str]:
        http = http or self.http
        ready = self.state_dir / "coordinator.json"
        ready.unlink(missing_ok=True)
        self.coordinator = self._spawn(
            "coordinator",
            [
                "-m", "bios.cli.coordinator",
                "--listen", listen,
                *(["--worker-port", str(worker_port)] if worker_port is not None else []),
                "--state-dir", str(self.state_dir),
                "--cycle-s", str(self.cycle_s),
                "--heartbeat-timeout", str(self.heartbeat_timeout_s),
                *(["--collective-timeout", str(self.collective_timeout_s)] if self.collective_timeout_s else []),
                "--ready-file", str(ready),
                "--log-level", self.log_level,
                "--checkpoint-every", str(self.checkpoint_every),
                "--keep-checkpoints", str(self.keep_checkpoints),
                "--log-format", self.log_format,
                *(["--http", http] if http else []),
                *(["--metrics", self.metrics] if self.metrics else []),
            ],
        )
        deadline = time.monotonic() + self.start_timeout_s
        while not ready.exists():
            if self.coordinator.poll() is not None:
                raise ClusterStartError(f"the coordinator exited at start: {self.last_error('coordinator')} "
                                        f"(log: {self.log_path('coordinator')})")
            if time.monotonic() > deadline:
                self.stop()
                raise exceptions.TimeoutError(f"the coordinator did not start within {self.start_timeout_s:.0f}s")
            time.sleep(0.02)
        self._addresses = json.loads(ready.read_text())
        return self._addresses

    def add_worker(self, memory_limit: str | int | None = None) -> subprocess.Popen[bytes]:
        """Start one more worker; `memory_limit` (bytes or e.g. "2GiB") overrides `worker_memory_limit`."""
        keys = KeyStore.open(self.state_dir)
        if keys is not None:  # a keyed state dir: workers join with its token (through the environment, not argv)
            self.env["BIOS_WORKER_TOKEN"] = str(keys.cluster.worker_token())
            keys.close()
        args = ["-m", "bios.cli.worker", "--coordinator", self.address, "--log-level", self.log_level]
        threads = self.worker_threads or threads_per_worker(self.num_workers)  # workers share this machine's cores
        args += ["--threads", str(threads)]
        limit = memory_limit if memory_limit is not None else self.worker_memory_limit
        if limit is not None:
            args += ["--memory-limit", str(limit)]
        worker = self._spawn(f"worker-{len(self.workers)}", args)
        self.workers.append(worker)
        return worker

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the coordinator (it tells its workers to exit), then make sure every child is gone."""
        children = [p for p in [self.coordinator, *self.workers] if p is not None]
        if self.coordinator is not None and self.coordinator.poll() is None:
            self.coordinator.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in children:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.terminate()
        for proc in children:
            try:
                proc.wait(2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.coordinator = None
        self.workers = []
        if self._owns_state_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start() if self.coordinator is None else self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------ helpers

    def log_path(self, name: str) -> Path:
        """Where the child `name` (`coordinator`, `worker-0`, ...) writes its output."""
        return self.state_dir / f"{name}.log"

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        with open(self.log_path(name), "ab") as log_file:
            return subprocess.Popen(
                [sys.executable, *args],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=self.env,
                preexec_fn=_die_with_parent,
            )

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.log_path(name)
        if not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def last_error(self, name: str) -> str:
        """The message of the last ERROR line of a child's log (its own words for why it stopped), else its last
        line."""
        lines = [line.strip() for line in self.log_tail(name, 200).splitlines() if line.strip()]
        errors = [line for line in lines if " ERROR " in line or '"level": "error"' in line]
        return _message((errors or lines or ["(empty log)"])[-1])


def _message(line: str) -> str:
    """A log line without its time, process, level and logger: text (`_TEXT_LOG`) or JSON (`msg`)."""
    if line.startswith("{"):
        with contextlib.suppress(ValueError, KeyError, TypeError):
            return str(json.loads(line)["msg"])
    match = _TEXT_LOG.match(line)
    return match.group(1) if match else line
