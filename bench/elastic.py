"""Many workers and shared base models:

1. recovery after a SIGKILL: from the kill to the next committed step, vs the heartbeat timeout;
2. 8 runs of batch 4 on one base model served together vs the same 8 runs one after another (aggregate
   tokens/s), and the worker's peak RSS with 8 adapters vs 1;
3. the all-reduce's share of a training cycle on a 2-worker CPU run.

    python bench/elastic.py [--model bios/tiny-llama] [--steps 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import signal
import statistics
import time

import psutil

import bios
from bios import types

HEARTBEAT_S = 3.0


def batch(n: int, seq: int, salt: int = 0) -> list[types.Datum]:
    out = []
    for i in range(n):
        tokens = [(salt * 31 + i * 7 + j * 13) % 250 + 1 for j in range(seq + 1)]
        out.append(types.Datum(types.ModelInput.from_ints(tokens[:-1]),
                               {"target_tokens": tokens[1:], "weights": [1.0] * seq}))
    return out


def wait_active(service: bios.ServiceClient, n: int) -> None:
    while sum(w.state == "active" for w in service.cluster_status().workers) < n:
        time.sleep(0.05)


def recovery(model: str, kills: int) -> list[float]:
    times = []
    with bios.LocalCluster(workers=2, heartbeat_timeout_s=HEARTBEAT_S, worker_threads=1) as cluster, \
            bios.ServiceClient(address=cluster.address) as service:
        wait_active(service, 2)
        tc = service.create_lora_training_client(model, rank=8, seed=0)
        data = batch(8, 128)
        for _ in range(kills):
            wait_active(service, 2)
            tc.forward_backward(data).result()
            fwd = tc.forward_backward(data)
            time.sleep(0.05)
            victim = next(w for w in cluster.workers if w.poll() is None)
            killed = time.perf_counter()
            victim.send_signal(signal.SIGKILL)
            cluster.add_worker()
            fwd.result(300)
            times.append(time.perf_counter() - killed)
    return times


async def _train_runs(service: bios.ServiceClient, model: str, runs: int, steps: int, seq: int) -> float:
    clients = [await service.create_lora_training_client_async(model, rank=8, seed=i) for i in range(runs)]
    data = [batch(4, seq, salt=i) for i in range(runs)]

    async def one(i: int) -> None:
        for _ in range(steps):
            await tc_step(clients[i], data[i])

    async def tc_step(tc: bios.TrainingClient, d: list[types.Datum]) -> None:
        f = await tc.forward_backward_async(d)
        o = await tc.optim_step_async()
        await f
        await o

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(runs)))
    return runs * steps * 4 * seq / (time.perf_counter() - started)


def shared_runs(model: str, runs: int, steps: int, seq: int) -> tuple[float, float, float, float]:
    """(together tokens/s, one-after-another tokens/s, worker RSS with `runs` adapters, with one)."""
    results = []
    for together in (False, True):
        with bios.LocalCluster(workers=1) as cluster, bios.ServiceClient(address=cluster.address) as service:
            worker = psutil.Process(cluster.workers[0].pid)
            if together:
                rate = asyncio.run(_train_runs(service, model, runs, steps, seq))
            else:
                rates = [asyncio.run(_train_runs(service, model, 1, steps, seq)) for _ in range(runs)]
                rate = runs / sum(1 / r for r in rates)
            results.append((rate, worker.memory_info().rss))
    (sequential, rss_one), (together, rss_all) = results
    return together, sequential, rss_all, rss_one


def allreduce_share(model: str, steps: int) -> tuple[float, dict[str, float]]:
    with bios.LocalCluster(workers=2, worker_threads=1) as cluster, bios.ServiceClient(address=cluster.address) as svc:
        wait_active(svc, 2)
        tc = svc.create_lora_training_client(model, rank=16, seed=0)
        data = batch(8, 128)
        tc.forward_backward(data).result()
        tc.optim_step().result()
        before = svc.cluster_status().phase_seconds
        for _ in range(steps):
            tc.forward_backward(data)
            tc.optim_step().result()
        after = svc.cluster_status().phase_seconds
    phases = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return phases.get("allreduce", 0.0) / max(phases.get("cycle", 1e-9), 1e-9), phases


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="bios/tiny-llama")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--kills", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; model {args.model}")

    times = recovery(args.model, args.kills)
    print(f"\nrecovery after SIGKILL (kill -> next committed step), heartbeat timeout {HEARTBEAT_S:g}s:")
    print(f"  median {statistics.median(times):.2f}s, max {max(times):.2f}s over {len(times)} kills; "
          f"target <= {HEARTBEAT_S + 2:g}s -> {'met' if max(times) <= HEARTBEAT_S + 2 else 'missed'}")

    together, sequential, rss_all, rss_one = shared_runs(args.model, 8, args.steps, 64)
    print("\n8 runs (batch 4) on one base model, one worker:")
    print(f"  one after another {sequential:9.0f} tokens/s (reference)")
    print(f"  served together   {together:9.0f} tokens/s  ratio {together / sequential:.2f} (target >= 1.5)")
    print(f"  worker peak RSS: 8 runs {rss_all / 2**20:.0f} MiB vs 1 run {rss_one / 2**20:.0f} MiB, "
          f"ratio {rss_all / rss_one:.2f} (target <= 1.3)")

    share, phases = allreduce_share(args.model, args.steps)
    print(f"\n2-worker CPU run: all-reduce is {share:.1%} of a training cycle "
          f"({', '.join(f'{k} {v:.2f}s' for k, v in sorted(phases.items()))})")


if __name__ == "__main__":
    main()
