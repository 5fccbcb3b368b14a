"""A 1-row run beside a 64-row run of the same base model on 4 CPU workers (issue 37's case): how often the small
run steps, and the pair's tokens/s, for three ways of sharing the workers, in the same run, rounds alternating.

- `shared`: what the coordinator does by default (`bios.coordinator.cycle_share` cuts the big batch over cycles
  only where the added cycles cost little: not on a CPU with a small model, so both share each cycle whole).
- `cut`: the big batch always cut into 4 cycles while the small run is active (`BIOS_CUT_COST=100`).
- `own worker`: the small run on a worker of its own and the big one on the other three, simulated with two
  clusters at once (Bios does not place two groups of one base model yet).

Each run's client sends a forward_backward and an optim_step, then waits for both (a plain training loop).

    python bench/small_beside_big.py [--model tiny|medium] [--rows 64] [--rounds 2] [--seconds 8]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import describe_machine  # noqa: E402
from placement import SEQ, batch, write_models  # noqa: E402  (rows of SEQ tokens; the random Llamas)

from bios import types  # noqa: E402

WAYS = ("shared", "cut", "own worker")
PARAMS = types.AdamParams(learning_rate=1e-4)


def steps_until(tc, rows: int, stop: threading.Event, done: list[int]) -> None:
    while not stop.is_set():
        forward, step = tc.forward_backward(batch(rows, len(done))), tc.optim_step(PARAMS)
        forward.result(600)
        step.result(600)
        done.append(rows)


def one_round(way: str, model: str, rows: int, seconds: float) -> dict[str, float]:
    """Both runs training at once for `seconds` (after a warm-up step each): steps/s of each, the pair's tokens/s."""
    import bios

    env = {"BIOS_CUT_COST": "100"} if way == "cut" else {}
    sizes = (3, 1) if way == "own worker" else (4,)
    with ExitStack() as stack:
        clusters = [stack.enter_context(bios.LocalCluster(workers=n, worker_threads=1, env=env)) for n in sizes]
        services = [stack.enter_context(bios.ServiceClient(address=c.address)) for c in clusters]
        big = services[0].create_lora_training_client(model, rank=8, seed=2)
        small = services[-1].create_lora_training_client(model, rank=8, seed=1)
        for tc, n in ((big, rows), (small, 1)):  # warm up: the model loaded, the adapters made
            tc.forward_backward(batch(n, 0)).result(600)
            tc.optim_step(PARAMS).result(600)
        stop = threading.Event()
        done: dict[str, list[int]] = {"big": [], "small": []}
        threads = [threading.Thread(target=steps_until, args=(tc, n, stop, done[name]))
                   for name, tc, n in (("big", big, rows), ("small", small, 1))]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        time.sleep(seconds)
        stop.set()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - started
    return {"small": len(done["small"]) / wall, "big": len(done["big"]) / wall,
            "tokens": (sum(done["small"]) + sum(done["big"])) * SEQ / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", choices=("tiny", "medium"))
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    print(describe_machine())
    model = write_models(Path(tempfile.mkdtemp(prefix="bench-small-big-")))[args.model]
    print(f"4 workers (1 thread each), {args.model} model, a 1-row and a {args.rows}-row run of {SEQ}-token rows, "
          f"{args.seconds:.0f} s a round")
    best: dict[str, dict[str, float]] = {}
    for round_ in range(args.rounds):
        for way in WAYS if round_ % 2 == 0 else reversed(WAYS):
            got = one_round(way, model, args.rows, args.seconds)
            print(f"round {round_ + 1} {way:10}: small {got['small']:5.2f} steps/s, big {got['big']:4.2f} steps/s, "
                  f"pair {got['tokens']:7.0f} tokens/s", flush=True)
            if way not in best or got["tokens"] > best[way]["tokens"]:
                best[way] = got
    shared = best["shared"]
    for way in WAYS[1:]:
        print(f"{way} / shared (best rounds): small run {best[way]['small'] / shared['small']:.2f}x steps/s, "
              f"pair {best[way]['tokens'] / shared['tokens']:.2f}x tokens/s (target: >= 3x and >= 1.0x)")


if __name__ == "__main__":
    main()
