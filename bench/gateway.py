"""The same pipelined training loop through the HTTP gateway (official `tinker` SDK) and the native Bios SDK.

    python bench/gateway.py [--steps 40] [--rounds 3] [--depth 4]

One embedded cluster serves both: native over ZeroMQ, Tinker over HTTP to the gateway in the coordinator. Each
round runs the native loop, then the gateway loop, on fresh runs of `bios/tiny-llama`, so machine noise hits
both alike; the table reports median steps/s and the gateway/native ratio (target >= 0.9).
"""

from __future__ import annotations

import argparse
import multiprocessing
import platform
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import tinker
from tinker import types as tt

import bios
from bios import types as bt

BASE = "bios/tiny-llama"
TEXTS = [f"Pipelined request {i} keeps the cluster busy between ticks." for i in range(8)]


def _inputs(text: str) -> tuple[list[int], dict[str, list[Any]]]:
    tokens = list(text.encode())
    return tokens[:-1], {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)}


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


def native_loop(service: bios.ServiceClient, steps: int, depth: int) -> float:
    tc = service.create_lora_training_client(BASE, rank=16, seed=0)
    batch = [bt.Datum(bt.ModelInput.from_ints(tokens), inputs) for tokens, inputs in map(_inputs, TEXTS)]
    params = bt.AdamParams(learning_rate=1e-3)
    pipelined(lambda: tc.forward_backward(batch, "cross_entropy"), lambda: tc.optim_step(params), 4, depth)  # warm
    return pipelined(lambda: tc.forward_backward(batch, "cross_entropy"), lambda: tc.optim_step(params), steps, depth)


def gateway_loop(service: tinker.ServiceClient, steps: int, depth: int) -> float:
    tc = service.create_lora_training_client(base_model=BASE, rank=16, seed=0).result()
    batch = [tt.Datum(model_input=tt.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)
             for tokens, inputs in map(_inputs, TEXTS)]
    params = tt.AdamParams(learning_rate=1e-3)
    pipelined(lambda: tc.forward_backward(batch, "cross_entropy"), lambda: tc.optim_step(params), 4, depth)
    return pipelined(lambda: tc.forward_backward(batch, "cross_entropy"), lambda: tc.optim_step(params), steps, depth)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--depth", type=int, default=4)
    args = parser.parse_args()
    native, gateway = [], []
    with bios.LocalCluster(http="127.0.0.1:0") as cluster:
        with bios.ServiceClient(address=cluster.address) as ours, \
                tinker.ServiceClient(base_url=cluster.http_url, api_key="tml-bench") as theirs:
            for _ in range(args.rounds):
                native.append(native_loop(ours, args.steps, args.depth))
                gateway.append(gateway_loop(theirs, args.steps, args.depth))
    print(f"machine: {platform.processor() or platform.machine()}, {multiprocessing.cpu_count()} cores; "
          f"{BASE}, batch {len(TEXTS)}, {args.steps} steps x {args.rounds} rounds, pipeline depth {args.depth}")
    print(f"{'path':<40} {'steps/s (median)':>17} {'all rounds':>24} {'ratio':>6}")
    ref = statistics.median(native)
    for name, runs in (("native SDK over ZeroMQ (reference)", native), ("tinker SDK over the HTTP gateway", gateway)):
        rounds = " ".join(f"{r:.1f}" for r in runs)
        print(f"{name:<40} {statistics.median(runs):17.2f} {rounds:>24} {statistics.median(runs) / ref:6.2f}")


if __name__ == "__main__":
    main()
