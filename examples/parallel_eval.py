"""Parallel evaluation: `asyncio.gather` over many `sample_async` calls.

Requests accepted before a cycle starts run in that cycle as one batch, so a whole eval set costs about as
much as its longest answer. Each round here trains a few steps, then evaluates the adapter on every prompt at
once.

    python examples/parallel_eval.py [ROUNDS]
"""

import asyncio
import sys
import time

import bios
from bios import types

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
STEPS_PER_ROUND = 4
TARGET = b" ok."
PROMPTS = [f"Request {i}:".encode() for i in range(32)]


def datum(prompt: bytes) -> types.Datum:
    """Teach the answer TARGET after every prompt (byte-level tokens of bios/tiny-llama)."""
    tokens = list(prompt + TARGET)
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(TARGET)
    return types.Datum(types.ModelInput.from_ints(tokens[:-1]), {"target_tokens": tokens[1:], "weights": weights})


async def evaluate(sampler: bios.SamplingClient) -> tuple[float, float]:
    """Share of prompts answered with TARGET, greedily, and the seconds the whole set took."""
    params = types.SamplingParams(max_tokens=len(TARGET), temperature=0.0)
    started = time.perf_counter()
    responses = await asyncio.gather(
        *(sampler.sample_async(types.ModelInput.from_ints(list(p)), 1, params) for p in PROMPTS)
    )
    correct = sum(r.sequences[0].tokens == list(TARGET) for r in responses)
    return correct / len(PROMPTS), time.perf_counter() - started


async def main() -> None:
    with bios.ServiceClient() as service:
        tc = await service.create_lora_training_client_async(base_model="bios/tiny-llama", rank=16, seed=0)
        batch = [datum(p) for p in PROMPTS]
        for round_ in range(ROUNDS + 1):
            if round_:
                for _ in range(STEPS_PER_ROUND):
                    await tc.forward_backward_async(batch, "cross_entropy")
                    await tc.optim_step_async(types.AdamParams(learning_rate=3e-3))
            sampler = await tc.save_weights_and_get_sampling_client_async()  # waits for the steps before it
            score, seconds = await evaluate(sampler)
            print(f"step {round_ * STEPS_PER_ROUND:3d}  {len(PROMPTS)} prompts in {seconds:.2f}s  "
                  f"exact answers {score:.0%}")


asyncio.run(main())
