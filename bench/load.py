"""Load: many concurrent clients against one keyed coordinator and two workers on `bios/tiny-llama`.

    python bench/load.py [--clients 64] [--ops 50] [--keys 4] [--max-queued 32]

Each client has its own `ServiceClient` (its own API key among `--keys`, CurveZMQ-encrypted), creates a LoRA run
and a base-model sampler, then runs `--ops` operations one after another, cycling through forward_backward,
optim_step, sample, get_info and list_training_runs. The coordinator's queue is capped below the number of
clients (`--max-queued`), so backpressure happens: refused requests are resent by the SDK, and counted here.
The coordinator's RSS is sampled every 50 ms. The reference is one client alone running the same operations
against the same cluster first: each operation's p50 under load is reported as a ratio to its p50 alone.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import platform
import statistics
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import psutil

import bios
from bios import types
from bios.exceptions import RateLimitError
from bios.security.keys import KeyStore

BASE = "bios/tiny-llama"
OPS = ("forward_backward", "optim_step", "sample", "get_info", "list_training_runs")


@dataclass
class LoadReport:
    clients: int
    ops_per_client: int
    latencies: dict[str, list[float]] = field(default_factory=dict)
    errors: Counter[str] = field(default_factory=Counter)
    rejects: int = 0  # requests refused with RateLimitError and resent by the SDK
    rss_start: int = 0  # coordinator RSS once every client has its run
    rss_peak: int = 0
    wall_s: float = 0.0
    alone_p50: dict[str, float] = field(default_factory=dict)  # the reference: one client by itself

    @property
    def requests(self) -> int:
        return sum(len(v) for v in self.latencies.values()) + sum(self.errors.values())

    def percentile(self, q: float, kind: str | None = None) -> float:
        values = sorted(v for k, vs in self.latencies.items() if kind in (None, k) for v in vs)
        return values[min(len(values) - 1, int(len(values) * q))] if values else float("nan")

    def summary(self) -> str:
        lines = [
            f"machine: {platform.processor() or platform.machine()}, {multiprocessing.cpu_count()} cores; "
            f"{self.clients} clients x {self.ops_per_client} ops in {self.wall_s:.1f}s",
            f"requests {self.requests}, errors {dict(self.errors) or 0}, backpressure rejects (resent) {self.rejects}",
            f"coordinator RSS: {self.rss_start / 2**20:.0f} MiB with all runs created, peak "
            f"{self.rss_peak / 2**20:.0f} MiB ({self.rss_peak / max(self.rss_start, 1):.2f}x)",
            f"{'operation':<22} {'count':>6} {'p50 ms':>9} {'p99 ms':>9} {'alone p50 ms':>13} {'p50 ratio':>10}",
        ]
        for kind in ("create", *OPS):
            if self.latencies.get(kind):
                p50, alone = self.percentile(0.5, kind), self.alone_p50.get(kind, float("nan"))
                lines.append(f"{kind:<22} {len(self.latencies[kind]):>6} {p50 * 1e3:9.1f} "
                             f"{self.percentile(0.99, kind) * 1e3:9.1f} {alone * 1e3:13.1f} {p50 / alone:10.2f}")
        lines.append(f"{'all':<22} {sum(len(v) for v in self.latencies.values()):>6} "
                     f"{self.percentile(0.5) * 1e3:9.1f} {self.percentile(0.99) * 1e3:9.1f}")
        return "\n".join(lines)


class RssSampler:
    """Peak RSS of one process, sampled on a thread (the coordinator is a child process)."""

    def __init__(self, pid: int, interval_s: float = 0.05) -> None:
        self.process = psutil.Process(pid)
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def now(self) -> int:
        return int(self.process.memory_info().rss)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def _client_ops(service: bios.ServiceClient, index: int, ops: int, report: LoadReport,
                      ready: asyncio.Barrier) -> None:
    def record(kind: str, started: float) -> None:
        report.latencies.setdefault(kind, []).append(time.perf_counter() - started)

    datum = _datum(f"client {index} learns its own little sentence")
    started = time.perf_counter()
    tc = await service.create_lora_training_client_async(BASE, rank=4, seed=index)
    sampler = await service.create_sampling_client_async(base_model=BASE)
    rest = service.create_rest_client()
    record("create", started)
    await ready.wait()  # every client starts its operations together
    for op in range(ops):
        kind = OPS[op % len(OPS)]
        started = time.perf_counter()
        try:
            if kind == "forward_backward":
                await (await tc.forward_backward_async([datum]))
            elif kind == "optim_step":
                await (await tc.optim_step_async(types.AdamParams(learning_rate=1e-3)))
            elif kind == "sample":
                await sampler.sample_async(datum.model_input, sampling_params=types.SamplingParams(max_tokens=4))
            elif kind == "get_info":
                await tc.get_info_async()
            else:
                await rest.list_training_runs_async()
        except RateLimitError:
            report.errors["RateLimitError"] += 1  # backpressure past the SDK's resends: allowed, but counted
        except Exception as exc:  # anything else is a failure of the run
            report.errors[f"{type(exc).__name__}: {exc}"[:160]] += 1
        else:
            record(kind, started)


def _datum(text: str) -> types.Datum:
    tokens = list(text.encode())
    return types.Datum(types.ModelInput.from_ints(tokens[:-1]),
                       {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


async def _drive(services: list[bios.ServiceClient], ops: int, report: LoadReport,
                 sampler: RssSampler | None = None) -> None:
    ready = asyncio.Barrier(len(services) + 1)
    tasks = [asyncio.create_task(_client_ops(s, i, ops, report, ready)) for i, s in enumerate(services)]
    await ready.wait()
    if sampler is not None:
        report.rss_start = sampler.now()
    await asyncio.gather(*tasks)


def run_load(clients: int = 64, ops: int = 50, keys: int = 4, workers: int = 2, max_queued: int = 32,
             retry_after_s: float = 0.25, state_dir: Path | None = None) -> LoadReport:
    """Start a keyed cluster with a queue cap below `clients`, run the clients, stop everything."""
    state_dir = Path(state_dir or tempfile.mkdtemp(prefix="bios-load-"))
    store, _ = KeyStore.init(state_dir)
    api_keys = [str(store.create(f"load-{k}")) for k in range(keys)]
    store.close()
    quotas = {"BIOS_QUOTA_MAX_QUEUED": str(max_queued), "BIOS_QUOTA_RETRY_AFTER_S": str(retry_after_s),
              "BIOS_LOG_LEVEL": "WARNING"}
    report = LoadReport(clients, ops)
    with bios.LocalCluster(state_dir=state_dir, workers=workers, worker_threads=1, log_level="WARNING",
                           env=quotas) as cluster:
        assert cluster.coordinator is not None
        with bios.ServiceClient(address=cluster.address, api_key=api_keys[0]) as alone:
            alone.create_lora_training_client(BASE, rank=4)  # the workers load the base model now, not measured
            reference = LoadReport(1, ops)
            asyncio.run(_drive([alone], ops, reference))
        report.alone_p50 = {kind: reference.percentile(0.5, kind) for kind in reference.latencies}
        services = [bios.ServiceClient(address=cluster.address, api_key=api_keys[i % keys]) for i in range(clients)]
        try:
            with RssSampler(cluster.coordinator.pid) as sampler:
                started = time.perf_counter()
                asyncio.run(_drive(services, ops, report, sampler))
                report.wall_s = time.perf_counter() - started
            report.rss_peak = sampler.peak
            report.rejects = sum(s._conn.rate_limited for s in services)
        finally:
            for service in services:
                service.close()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--ops", type=int, default=50)
    parser.add_argument("--keys", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-queued", type=int, default=32, help="the coordinator's cap on unfinished requests")
    args = parser.parse_args()
    report = run_load(args.clients, args.ops, args.keys, args.workers, args.max_queued)
    print(report.summary())


if __name__ == "__main__":
    main()
