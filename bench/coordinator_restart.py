"""What the coordinator's fault tolerance costs and how fast it comes back.

    python bench/coordinator_restart.py [--model smollm2] [--rounds 3] [--steps 8] [--every 10]

1. Restart: a 2-worker cluster trains; the coordinator is SIGKILLed between steps and started again on its state
   dir; timed from the new process's start to the first completed request (the client reconnects, the workers
   register again and are adopted, the request runs). Target: <= 2 s plus the workers' reconnect.
2. Automatic checkpoints: steps/s of a pipelined training loop on the embedded cluster with `--checkpoint-every
   N` vs off, rounds alternating so machine load falls on both. Target: <= 5% slower with the default.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from machine import describe_machine  # noqa: E402
from training_throughput import make_batch, pipelined_steps_per_s  # noqa: E402

import bios  # noqa: E402
from bios import types  # noqa: E402
from bios.cluster_defaults import CHECKPOINT_EVERY as DEFAULT_CHECKPOINT_EVERY  # noqa: E402
from bios.models import load_base_model, resolve_model_dir  # noqa: E402


def restart_seconds(model: str, data: list[types.Datum]) -> tuple[float, float]:
    """(seconds from the new coordinator's start to a completed request, of which the process start)."""
    with tempfile.TemporaryDirectory() as state, \
            bios.LocalCluster(workers=2, cycle_s=0.0, state_dir=state, checkpoint_every=1) as cluster:
        service = bios.ServiceClient(address=cluster.address)
        tc = service.create_lora_training_client(model, rank=8, seed=0)
        tc.forward_backward(data).result(600)
        tc.optim_step(types.AdamParams(learning_rate=1e-4)).result(600)
        cluster.coordinator.kill()
        cluster.coordinator.wait()
        started = time.perf_counter()
        cluster.start_coordinator_again()
        ready = time.perf_counter() - started
        tc.forward(data[:1]).result(600)
        total = time.perf_counter() - started
        service.close()
    return total, ready


async def steps_per_s(model: str, data: list[types.Datum], steps: int, every: int, depth: int = 4) -> float:
    with tempfile.TemporaryDirectory() as state, \
            bios.LocalCluster(cycle_s=0.0, state_dir=state, checkpoint_every=every) as cluster:
        service = bios.ServiceClient(address=cluster.address)
        tc = await service.create_lora_training_client_async(model, rank=16, seed=0)
        await pipelined_steps_per_s(tc, data, 2, depth)  # warm-up
        rate = await pipelined_steps_per_s(tc, data, steps, depth)
        service.close()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=DEFAULT_CHECKPOINT_EVERY)
    args = parser.parse_args()
    resolve_model_dir(args.model)
    data = make_batch(load_base_model(args.model).info.vocab_size, [128] * 4)
    print(describe_machine())
    restarts = [restart_seconds(args.model, data) for _ in range(args.rounds)]
    print(f"restart to first completed request: median {statistics.median(r[0] for r in restarts):.2f}s "
          f"(process start to ready: {statistics.median(r[1] for r in restarts):.2f}s), rounds "
          + ", ".join(f"{r[0]:.2f}" for r in restarts))
    off, on = [], []
    for _ in range(args.rounds):
        off.append(asyncio.run(steps_per_s(args.model, data, args.steps, 0)))
        on.append(asyncio.run(steps_per_s(args.model, data, args.steps, args.every)))
    ratio = statistics.median(on) / statistics.median(off)
    print(f"model {args.model}, batch 4x128, rank 16, {args.steps} steps per round, {args.rounds} rounds alternating")
    print(f"{'automatic checkpoints':<34} {'steps/s (median)':>17} {'ratio':>6}")
    print(f"{'off':<34} {statistics.median(off):17.3f} {1.0:6.2f}")
    print(f"{f'every {args.every} step(s)':<34} {statistics.median(on):17.3f} {ratio:6.3f}")
    print("rounds off: " + ", ".join(f"{x:.3f}" for x in off) + "; on: " + ", ".join(f"{x:.3f}" for x in on))


if __name__ == "__main__":
    main()
