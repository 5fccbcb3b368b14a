"""Steady-state training steps/s: Bios's pipelined async loop on the embedded cluster vs an in-process
PyTorch + PEFT + torch.optim.AdamW loop on the same model, batch and LoRA settings.

    python bench/training_throughput.py [--model smollm2] [--steps 20] [--batch 4] [--seq 128] [--rank 16]
                                        [--rounds 3]

Both sides run the same arithmetic (forward, backward of the summed cross-entropy, AdamW); Bios adds the
SDK → coordinator → worker round trips, which pipelining (depth 4) hides behind compute. Rounds alternate (PEFT,
then Bios on a fresh embedded cluster), so load from other jobs falls on both; the ratio is the median of the
rounds' ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections import deque
from pathlib import Path

import torch

import bios
from bios import types
from bios.models import load_base_model, resolve_model_dir
from bios.worker.adapter import LORA_ALPHA, lora_targets

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe_machine  # noqa: E402


def make_batch(vocab: int, lengths: list[int]) -> list[types.Datum]:
    """Seeded random rows of `lengths` tokens, each predicting its next token."""
    generator = torch.Generator().manual_seed(0)
    data = []
    for length in lengths:
        tokens = torch.randint(0, vocab, (length + 1,), generator=generator).tolist()
        data.append(types.Datum(types.ModelInput.from_ints(tokens[:-1]),
                                {"target_tokens": tokens[1:], "weights": [1.0] * length}))
    return data


def peft_steps_per_s(model_name: str, data: list[types.Datum], rank: int, steps: int, warmup: int) -> float:
    import peft

    base = load_base_model(model_name)
    modules = sorted({t.module_name.rsplit(".", 1)[-1] for t in lora_targets(base.model, types.LoraConfig(rank))})
    model = peft.get_peft_model(base.model, peft.LoraConfig(r=rank, lora_alpha=LORA_ALPHA, target_modules=modules,
                                                            lora_dropout=0.0))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0, foreach=True)
    ids = torch.tensor([d.model_input.to_ints() for d in data])
    targets = torch.stack([d.loss_fn_inputs["target_tokens"].to_torch() for d in data])
    weights = torch.stack([d.loss_fn_inputs["weights"].to_torch() for d in data])

    def step() -> None:
        logits = model(input_ids=ids).logits.float()
        logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
        (-(weights * logp).sum()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    for _ in range(warmup):
        step()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    return steps / (time.perf_counter() - started)


async def pipelined_steps_per_s(tc: bios.TrainingClient, data: list[types.Datum], steps: int, depth: int) -> float:
    """`steps` (forward_backward, optim_step) pairs with up to `depth` steps in flight; steps per second.

    Both results of every step are awaited, so a failed forward_backward (out of memory, say) raises here
    instead of leaving an optimizer step with no gradient to be timed."""
    params = types.AdamParams(learning_rate=1e-4)
    in_flight: deque = deque()
    started = time.perf_counter()
    for _ in range(steps):
        forward_backward = await tc.forward_backward_async(data, "cross_entropy")
        in_flight.append((forward_backward, await tc.optim_step_async(params)))
        if len(in_flight) >= depth:
            for future in in_flight.popleft():
                await future
    while in_flight:
        for future in in_flight.popleft():
            await future
    return steps / (time.perf_counter() - started)


async def bios_steps_per_s(model_name: str, data: list[types.Datum], rank: int, steps: int, warmup: int,
                           depth: int) -> float:
    with bios.ServiceClient() as service:
        tc = await service.create_lora_training_client_async(model_name, rank=rank, seed=0)
        await pipelined_steps_per_s(tc, data, warmup, depth)
        return await pipelined_steps_per_s(tc, data, steps, depth)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    resolve_model_dir(args.model)  # pull or write the model once, outside the timings
    vocab = load_base_model(args.model).info.vocab_size
    data = make_batch(vocab, [args.seq] * args.batch)
    print(describe_machine())
    references, measured = [], []
    for _ in range(args.rounds):
        references.append(peft_steps_per_s(args.model, data, args.rank, args.steps, args.warmup))
        measured.append(asyncio.run(bios_steps_per_s(args.model, data, args.rank, args.steps, args.warmup,
                                                     args.depth)))
    ratios = [bios_rate / peft_rate for bios_rate, peft_rate in zip(measured, references)]
    print(f"model {args.model}, batch {args.batch}x{args.seq}, LoRA rank {args.rank}, all linear layers, "
          f"{args.rounds} rounds of {args.steps} steps")
    print(f"{'loop':<46} {'steps/s':>8} {'ratio':>6}")
    print(f"{'in-process PyTorch + PEFT + AdamW (reference)':<46} {statistics.median(references):8.3f} {1.0:6.2f}")
    print(f"{f'bios, pipelined async (depth {args.depth})':<46} {statistics.median(measured):8.3f} "
          f"{statistics.median(ratios):6.2f}   rounds: {' '.join(f'{r:.2f}' for r in ratios)}")
    print(f"(after the run) {describe_machine()}")


if __name__ == "__main__":
    main()
