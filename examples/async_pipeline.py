"""The pipelined async loop: keep 4 steps in flight so every cycle has work queued before its tick.

The first await of each call returns once the coordinator has accepted and ordered the request; the second
await (on the returned future) returns its result.

    python examples/async_pipeline.py [STEPS]
"""

import asyncio
import sys
import time
from collections import deque

import bios
from bios import types

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 40
DEPTH = 4


def datum(text: str) -> types.Datum:
    tokens = list(text.encode())
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


BATCH = [datum(f"Pipelined request {i} keeps the cluster busy between ticks.") for i in range(8)]


async def main() -> None:
    with bios.ServiceClient() as service:
        tc = await service.create_lora_training_client_async(base_model="bios/tiny-llama", rank=16)
        in_flight: deque = deque()
        started = time.perf_counter()
        for step in range(STEPS):
            fwd = await tc.forward_backward_async(BATCH, "cross_entropy")
            opt = await tc.optim_step_async(types.AdamParams(learning_rate=1e-3))
            in_flight.append((step, fwd, opt))
            if len(in_flight) >= DEPTH:
                await report(*in_flight.popleft())
        while in_flight:
            await report(*in_flight.popleft())
        print(f"{STEPS / (time.perf_counter() - started):.1f} steps/s with pipeline depth {DEPTH}")


async def report(step, fwd, opt) -> None:
    out, stepped = await fwd, await opt
    print(f"step {step:3d}  loss {out.loss:9.3f}  lr {stepped.learning_rate:g}")


asyncio.run(main())
