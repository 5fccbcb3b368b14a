"""The same pipelined training loop through the HTTP gateway (official `tinker` SDK) and the native Bios SDK.

    python bench/gateway.py [--model bios/tiny-llama] [--steps 20] [--rounds 7] [--depth 4]

One embedded cluster serves both: native over ZeroMQ, Tinker over HTTP to the gateway in the coordinator, one
run each (the texts' bytes are the tokens, valid ids for every model here). The gateway adds a fixed CPU cost
per step (HTTP, the tinker SDK's own work in the client); on a 2-core machine it competes with the worker, so
the ratio depends on how long a step computes: a tiny model shows the overhead, a real one the steady state. Rounds alternate native and gateway, so a busy spell on a shared machine hits
adjacent rounds alike; the table reports median steps/s, the median of the per-round gateway/native ratios
(target >= 0.9), and the CPU time per step of the client process and of the coordinator (which hosts the
gateway), which other load disturbs less than wall time.
"""

from __future__ import annotations

import argparse
import multiprocessing
import platform
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil
import tinker
from tinker import types as tt

import bios
from bios import types as bt

TEXTS = [f"Pipelined request {i} keeps the cluster busy between ticks." for i in range(8)]


def _inputs(text: str) -> tuple[list[int], dict[str, list[Any]]]:
    tokens = list(text.encode())
    return tokens[:-1], {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)}


@dataclass(frozen=True)
class Measure:
    steps_per_s: float
    client_cpu_ms: float  # per step
    coordinator_cpu_ms: float  # per step


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def measured(coordinator: psutil.Process, loop: Callable[[], float], steps: int) -> Measure:
    client = psutil.Process()
    client_cpu, coordinator_cpu = _cpu_s(client), _cpu_s(coordinator)
    rate = loop()
    return Measure(rate, (_cpu_s(client) - client_cpu) / steps * 1e3,
                   (_cpu_s(coordinator) - coordinator_cpu) / steps * 1e3)


def pipelined(forward_backward: Callable[[], Any], optim_step: Callable[[], Any], steps: int, depth: int) -> float:
    """Steps/s of a loop that keeps `depth` steps in flight, waiting on the oldest step's results."""
    in_flight: deque[tuple[Any, Any]] = deque()
    started = time.perf_counter()
    for _ in range(steps):
        in_flight.append((forward_backward(), optim_step()))
        if len(in_flight) >= depth:
            fwd, opt = in_flight.popleft()
            fwd.result(), opt.result()
    while in_flight:
        fwd, opt = in_flight.popleft()
        fwd.result(), opt.result()
    return steps / (time.perf_counter() - started)


Loop = Callable[[int], float]  # steps -> steps/s


def native_loop(service: bios.ServiceClient, model: str, depth: int) -> Loop:
    tc = service.create_lora_training_client(model, rank=16, seed=0)
    batch = [bt.Datum(bt.ModelInput.from_ints(tokens), inputs) for tokens, inputs in map(_inputs, TEXTS)]
    params = bt.AdamParams(learning_rate=1e-3)
    return lambda steps: pipelined(lambda: tc.forward_backward(batch, "cross_entropy"),
                                   lambda: tc.optim_step(params), steps, depth)


def gateway_loop(service: tinker.ServiceClient, model: str, depth: int) -> Loop:
    tc = service.create_lora_training_client(base_model=model, rank=16, seed=0).result()
    batch = [tt.Datum(model_input=tt.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)
             for tokens, inputs in map(_inputs, TEXTS)]
    params = tt.AdamParams(learning_rate=1e-3)
    return lambda steps: pipelined(lambda: tc.forward_backward(batch, "cross_entropy"),
                                   lambda: tc.optim_step(params), steps, depth)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="bios/tiny-llama")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--depth", type=int, default=4)
    args = parser.parse_args()
    native: list[Measure] = []
    gateway: list[Measure] = []
    with bios.LocalCluster(http="127.0.0.1:0") as cluster:
        assert cluster.coordinator is not None
        coordinator = psutil.Process(cluster.coordinator.pid)
        with bios.ServiceClient(address=cluster.address) as ours, \
                tinker.ServiceClient(base_url=cluster.http_url, api_key="tml-bench") as theirs:
            loops = {"native": native_loop(ours, args.model, args.depth),
                     "gateway": gateway_loop(theirs, args.model, args.depth)}
            for loop in loops.values():
                loop(4)  # warm up
            for _ in range(args.rounds):
                native.append(measured(coordinator, lambda: loops["native"](args.steps), args.steps))
                gateway.append(measured(coordinator, lambda: loops["gateway"](args.steps), args.steps))
    print(f"machine: {platform.processor() or platform.machine()}, {multiprocessing.cpu_count()} cores, "
          f"load {psutil.getloadavg()[0]:.1f}; {args.model}, batch {len(TEXTS)}, {args.rounds} rounds of {args.steps} "
          f"steps, pipeline depth {args.depth}")
    print(f"{'path':<38} {'steps/s':>8} {'ratio':>6} {'client CPU ms/step':>19} {'coordinator CPU ms/step':>24}")
    ratio = statistics.median(g.steps_per_s / n.steps_per_s for g, n in zip(gateway, native))
    for name, runs, rel in (("native SDK over ZeroMQ (reference)", native, 1.0),
                            ("tinker SDK over the HTTP gateway", gateway, ratio)):
        rate = statistics.median(m.steps_per_s for m in runs)
        client = statistics.median(m.client_cpu_ms for m in runs)
        coord = statistics.median(m.coordinator_cpu_ms for m in runs)
        print(f"{name:<38} {rate:8.2f} {rel:6.2f} {client:19.1f} {coord:24.1f}")
    print("per-round steps/s, native / gateway: "
          + "  ".join(f"{n.steps_per_s:.1f}/{g.steps_per_s:.1f}" for n, g in zip(native, gateway)))


if __name__ == "__main__":
    main()
