"""Observability of the coordinator: Prometheus metrics, a log line per request carrying its run and request
ids, and a JSON log format that keeps those ids as fields.

Instruments live in their own `CollectorRegistry`, so several coordinators in one process (tests) never share
counters. Event counters (cycles, requests, tokens, latencies) are updated where the events happen; state
gauges (queue depth, workers, busy fraction) are refreshed from the coordinator at each scrape. The endpoint
is an aiohttp route on the coordinator's own event loop, so a scrape never races the scheduler.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from bios import messages as m
from bios import types as t
from bios.ids import target_of

log = logging.getLogger(__name__)

# Cycles run from milliseconds (control ops on tiny models) to minutes (large batches on CPU).
CYCLE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Accept -> done includes waiting for the tick (up to `cycle_s`) and the cycle itself.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
WORKER_STATES = ("active", "joining", "idle", "waiting", "leaving", "dead")
# Rare, meaningful requests are logged at INFO; the rest (every training step) at DEBUG.
_INFO_OPS = frozenset({"create_model", "save_weights", "load_weights"})
# Attributes a log call may pass with `extra=` that the JSON format keeps as fields.
LOG_FIELDS = ("run_id", "request_id", "op", "latency_s", "cycle_id", "worker_id")


def op_name(op: m.Request | None) -> str:
    """`forward_backward`, `forward`, `optim_step`, `sample`, `create_model`, ...: the label of a request."""
    if isinstance(op, m.ForwardBackward) and op.forward_only:
        return "forward"
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(op).__name__).lower()


def tokens_of(op: m.Request | None, result: Any) -> int:
    """Tokens a finished request put through a model: training inputs, or sampling prompts plus output."""
    if isinstance(op, m.ForwardBackward):
        return sum(datum.model_input.length for datum in op.data)
    if isinstance(op, m.Sample) and isinstance(result, t.SampleResponse):
        return op.prompt.length + sum(len(sequence.tokens) for sequence in result.sequences)
    return 0


class CoordinatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.cycles = Counter("bios_cycles", "Cycles run, by outcome (committed or aborted and re-run)",
                              ["outcome"], registry=r)
        self.cycle_seconds = Histogram("bios_cycle_duration_seconds", "Wall time of one cycle on the workers",
                                       buckets=CYCLE_BUCKETS, registry=r)
        self.busy_fraction = Gauge("bios_busy_fraction", "Share of the coordinator's uptime spent running cycles",
                                   registry=r)
        self.queue_depth = Gauge("bios_queue_depth", "Accepted requests waiting for a cycle, per base-model pool",
                                 ["pool"], registry=r)
        self.request_seconds = Histogram("bios_request_duration_seconds",
                                         "From acceptance (the first await) to the result, per operation",
                                         ["op"], buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("bios_requests", "Requests per operation and outcome: ok, error (failed while "
                                "running) or rejected (refused at acceptance)",
                                ["op", "outcome"], registry=r)
        self.workers = Gauge("bios_workers", "Workers by state", ["state"], registry=r)
        self.tokens = Counter("bios_tokens", "Tokens through a model: training/forward inputs, sampling prompts "
                              "and sampled tokens", ["op"], registry=r)
        self._accepted: dict[str, tuple[str, float]] = {}
        self._pools: set[str] = set()

    # ------------------------------------------------------------------------------------ events

    def request_accepted(self, request_id: str, op: m.Request) -> None:
        self._accepted[request_id] = (op_name(op), time.monotonic())

    def request_finished(self, request_id: str, op: m.Request | None, result: Any, error: Any) -> None:
        """Count and time a finished request, and log it with its run and request ids."""
        name, accepted_at = self._accepted.pop(request_id, (op_name(op), None))
        outcome = "error" if error is not None else "ok"
        self.requests.labels(name, outcome).inc()
        latency = None if accepted_at is None else time.monotonic() - accepted_at
        if latency is not None:
            self.request_seconds.labels(name).observe(latency)
        tokens = tokens_of(op, result) if error is None else 0
        if tokens:
            self.tokens.labels(name).inc(tokens)
        run_id = target_of(request_id)
        ids = {"run_id": run_id, "request_id": request_id, "op": name, "latency_s": latency}
        if error is not None:
            log.warning("request %s (%s) of %s failed: %s", request_id, name, run_id,
                        getattr(error, "message", error), extra=ids)
        else:
            log.log(logging.INFO if name in _INFO_OPS else logging.DEBUG, "request %s (%s) of %s done in %s",
                    request_id, name, run_id, "?" if latency is None else f"{latency:.3f}s", extra=ids)

    def request_rejected(self, request_id: str, op: m.Request | None, reason: str) -> None:
        """A request refused at acceptance (bad input, unknown run...): counted, logged at INFO, never timed."""
        name = op_name(op)
        self.requests.labels(name, "rejected").inc()
        run_id = target_of(request_id)
        log.info("request %s (%s) of %s rejected: %s", request_id, name, run_id, reason,
                 extra={"run_id": run_id, "request_id": request_id, "op": name})

    def cycle_ran(self, duration_s: float, *, aborted: bool) -> None:
        self.cycles.labels("aborted" if aborted else "committed").inc()
        self.cycle_seconds.observe(duration_s)

    # ------------------------------------------------------------------------------------ state

    def observe_status(self, status: m.ClusterStatus, queue_depths: Mapping[str, int]) -> None:
        """Refresh the state gauges (called at each scrape)."""
        self.busy_fraction.set(status.busy_s / status.uptime_s if status.uptime_s > 0 else 0.0)
        counts = dict.fromkeys(WORKER_STATES, 0)
        for worker in status.workers:
            counts[worker.state] = counts.get(worker.state, 0) + 1
        for state, count in counts.items():
            self.workers.labels(state).set(count)
        self._pools |= set(queue_depths)
        for pool in self._pools:  # a pool whose queue emptied reads 0, not its last value
            self.queue_depth.labels(pool).set(queue_depths.get(pool, 0))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class MetricsServer:
    """`GET /metrics` in the Prometheus text format; `refresh` updates the state gauges first."""

    def __init__(self, metrics: CoordinatorMetrics, refresh: Callable[[], Awaitable[None]]) -> None:
        self.metrics = metrics
        self.refresh = refresh
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _scrape(self, request: web.Request) -> web.Response:
        await self.refresh()
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def start(self, address: str) -> str:
        host, port = split_address(address)
        app = web.Application()
        app.add_routes([web.get("/metrics", self._scrape)])
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        bound = self._runner.addresses[0][1]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{bound}/metrics"
        log.info("Prometheus metrics on %s", self.url)
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


def split_address(address: str) -> tuple[str, int]:
    """"HOST:PORT" (or "[v6]:PORT", or ":PORT" for loopback) -> (host, port); port 0 picks a free one."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--metrics takes HOST:PORT (e.g. 127.0.0.1:9600, port 0 for a free one), got {address!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


async def serve_metrics(metrics: CoordinatorMetrics, address: str,
                        refresh: Callable[[], Awaitable[None]]) -> MetricsServer:
    server = MetricsServer(metrics, refresh)
    await server.start(address)
    return server


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: time, process, level, logger, message, and any of `LOG_FIELDS` the line has."""

    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": round(record.created, 3),
            "process": self.process,
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        line.update({key: getattr(record, key) for key in LOG_FIELDS if getattr(record, key, None) is not None})
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)
