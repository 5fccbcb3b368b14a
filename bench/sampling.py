"""Sampling throughput against Hugging Face `generate` on the same weights, in the dtype the worker runs
(its default, or `BIOS_BASE_DTYPE=float32`):

1. RL's shape, the fair baseline: 16 samples x 64 tokens of one ~50-token prompt, one `sample(num_samples=16)`
   request (the worker prefills the prompt once) against one batched `generate(num_return_sequences=16)`,
   rounds alternating in one process;
2. 16 concurrent `sample` requests of different prompts (batched by the worker) vs 16 sequential `generate`
   calls, and single-request latency vs one `generate`.

    python bench/sampling.py [--model smollm2] [--requests 16] [--tokens 64] [--rounds 5]
    BIOS_BASE_DTYPE=float32 python bench/sampling.py
    BIOS_BASE_DTYPE=float32 python bench/sampling.py --adapter fresh   # 1. through a LoRA adapter (PEFT's)

Both sides sample at temperature 1 with a KV cache and never stop early (`stop=[]` / no EOS), so they produce
the same number of tokens.

The machine's limit: a decode step of 16 sequences reads every weight matrix once for 16 rows, so it cannot be
faster than those matmuls alone. `decode_matmul_floor` times exactly them (each linear layer and the head on a
[16, in] input, in model order, nothing else), and the bench prints the tokens/s that floor allows next to
the measured rates: on CPU these matmuls stream the weights from DRAM, so no sampler reading the same weights
in the same dtype can beat that ceiling.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import bios
from bios import types
from bios.kernels.frozen_matmul import frozen_linear
from bios.kernels.prepacked import PrepackedWeights
from bios.models import load_base_model, resolve_model_dir
from bios.worker.compute_mode import base_dtype

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe_machine  # noqa: E402

PROMPTS = [f"Question {i}: tell me something about the number {i * 7}." for i in range(64)]


def hf_generate(model_name: str, prompts: list[list[int]], tokens: int, dtype: torch.dtype) -> tuple[float, float]:
    """(tokens/s over sequential calls, median single-call latency)."""
    loaded = load_base_model(model_name, dtype=dtype)
    model = loaded.model
    latencies = []
    generated = 0
    model.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=True)  # warm-up
    for prompt in prompts:
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, min_new_tokens=tokens,
                                 do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                                 pad_token_id=loaded.tokenizer.pad_token_id)
        latencies.append(time.perf_counter() - started)
        generated += out.shape[1] - len(prompt)
    return generated / sum(latencies), statistics.median(latencies)


async def bios_sample(model_name: str, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    params = types.SamplingParams(max_tokens=tokens, temperature=1.0, stop=[])
    with bios.ServiceClient() as service:
        sampler = await service.create_sampling_client_async(base_model=model_name)
        await sampler.sample_async(types.ModelInput.from_ints(prompts[0]), 1,
                                   types.SamplingParams(max_tokens=4, stop=[]))  # warm-up: loads the model
        latencies = []
        for prompt in prompts[:4]:
            started = time.perf_counter()
            await sampler.sample_async(types.ModelInput.from_ints(prompt), 1, params)
            latencies.append(time.perf_counter() - started)
        started = time.perf_counter()
        results = await asyncio.gather(*(sampler.sample_async(types.ModelInput.from_ints(p), 1, params)
                                         for p in prompts))
        elapsed = time.perf_counter() - started
    generated = sum(len(s.tokens) for r in results for s in r.sequences)
    return generated / elapsed, statistics.median(latencies)


# Where `--adapter` puts rank-16 LoRA on the reference: every linear layer and the head, as Bios's default.
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


async def one_prompt_many_samples(model_name: str, prompt: list[int], samples: int, tokens: int, *, rounds: int,
                                  device: torch.device, dtype: torch.dtype,
                                  adapter: str | None = None) -> tuple[list[float], list[float]]:
    """Tokens/s per round of one batched HF `generate(num_return_sequences=samples)` and of one Bios
    `sample(num_samples=samples)` of `prompt`, rounds alternating after a warm-up of each.

    `adapter` samples through a rank-16 LoRA adapter on both sides (PEFT on the reference): "kept", one
    snapshot of it for every round (a served adapter); "fresh", a new snapshot each round, saved outside the
    timing (RL's loop, where every sampling call follows a training step and nothing made for the last
    snapshot is of use)."""
    model = load_base_model(model_name, device=device, dtype=dtype).model
    if adapter is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=PEFT_TARGETS))
    ids = torch.tensor([prompt], device=device)
    kwargs = {"do_sample": True, "top_k": 0, "top_p": 1.0, "temperature": 1.0, "num_return_sequences": samples,
              "pad_token_id": 0}
    params = types.SamplingParams(max_tokens=tokens, temperature=1.0, stop=[])
    hf_rates, bios_rates = [], []
    with bios.ServiceClient() as service:
        if adapter is None:
            sampler = await service.create_sampling_client_async(base_model=model_name)
        else:
            training = await service.create_lora_training_client_async(base_model=model_name, rank=16)
            sampler = await training.save_weights_and_get_sampling_client_async()
        await sampler.sample_async(types.ModelInput.from_ints(prompt), samples, params)  # warm-up: loads the model
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=4, **kwargs)
        for _ in range(rounds):
            if adapter == "fresh":
                sampler = await training.save_weights_and_get_sampling_client_async()
            _sync(device)
            started = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kwargs)
            _sync(device)
            hf_rates.append(out.shape[0] * (out.shape[1] - len(prompt)) / (time.perf_counter() - started))
            started = time.perf_counter()
            result = await sampler.sample_async(types.ModelInput.from_ints(prompt), samples, params)
            bios_rates.append(sum(len(s.tokens) for s in result.sequences) / (time.perf_counter() - started))
    return hf_rates, bios_rates


def decode_matmul_floor(model_name: str, rows: int, dtype: torch.dtype, rounds: int = 5) -> float:
    """Seconds of one decode step's weight matmuls alone (fastest of `rounds`, through the fastest of PyTorch's
    own matmul, oneDNN's with prepacked weights and, on Intel CPUs, MKL's packed ones: `bios.kernels.frozen_matmul`,
    `bios.kernels.prepacked`): the floor of any sampler that reads these weights in this dtype for `rows`
    sequences per step with these libraries. A Llama-family layer's q/k/v and gate/up weights count stacked, one
    product each, as the sampler multiplies them (`bios.kernels.prepacked.prepacked_stack`)."""
    model = load_base_model(model_name, dtype=dtype).model
    weights = _stacked_by_input(model)
    inputs = {weight.shape[1]: torch.randn(rows, weight.shape[1], dtype=weight.dtype) for weight in weights}
    best, setting = float("inf"), os.environ.get("BIOS_GEMM")
    with torch.inference_mode(), PrepackedWeights().using(rows=rows):
        for _ in range(rounds):
            for backend in ("aten", "onednn", "auto"):
                os.environ["BIOS_GEMM"] = backend
                started = time.perf_counter()
                for weight in weights:
                    frozen_linear(inputs[weight.shape[1]], weight)
                best = min(best, time.perf_counter() - started)
    if setting is None:
        os.environ.pop("BIOS_GEMM")
    else:
        os.environ["BIOS_GEMM"] = setting
    return best


def _stacked_by_input(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every linear layer's weight in model order, a decoder layer's q, k and v (gate and up) stacked into one."""
    weights, stacks = [], {("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")}
    for module in model.modules():
        names = {name for name, child in module.named_children() if isinstance(child, torch.nn.Linear)}
        for stack in stacks:
            if set(stack) <= names:
                weights.append(torch.cat([getattr(module, name).weight for name in stack]))
                names -= set(stack)
        weights += [getattr(module, name).weight for name in sorted(names)]
    return weights


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of the one-prompt comparison")
    parser.add_argument("--adapter", choices=["kept", "fresh"],
                        help="the one-prompt comparison through a rank-16 adapter (PEFT on the reference): one "
                             "snapshot for all rounds, or a new one each round as in RL; skips the rest")
    args = parser.parse_args()
    resolve_model_dir(args.model)
    tokenizer = load_base_model(args.model).tokenizer
    prompts = [tokenizer.encode(p) for p in PROMPTS[: args.requests]]
    device = torch.device("cpu")
    dtype = base_dtype(device).dtype or torch.float32
    print(describe_machine())
    print(f"model {args.model} in {str(dtype).removeprefix('torch.')} on both sides, {args.tokens} new tokens per "
          f"sequence, temperature 1", flush=True)
    one_prompt = [token for prompt in prompts for token in prompt][:50]
    hf_rates, bios_rates = asyncio.run(one_prompt_many_samples(args.model, one_prompt, args.requests, args.tokens,
                                                               rounds=args.rounds, device=device, dtype=dtype,
                                                               adapter=args.adapter))
    if args.adapter is not None:
        hf_one, bios_one = statistics.median(hf_rates), statistics.median(bios_rates)
        print(f"rank-16 adapter on every linear layer and the head ({args.adapter} snapshot), {args.requests} "
              f"samples of one {len(one_prompt)}-token prompt: HF generate + PEFT {hf_one:.1f} tok/s, bios "
              f"{bios_one:.1f} tok/s, {bios_one / hf_one:.2f}x (rounds: "
              + " ".join(f"{b / h:.2f}" for b, h in zip(bios_rates, hf_rates)) + ")")
        print(f"\n(after the run) {describe_machine()}")
        return
    floor = decode_matmul_floor(args.model, args.requests, dtype)
    ref_rate, ref_latency = hf_generate(args.model, prompts, args.tokens, dtype)
    rate, latency = asyncio.run(bios_sample(args.model, prompts, args.tokens))
    hf_one, bios_one = statistics.median(hf_rates), statistics.median(bios_rates)
    print(f"\n{'':<58} {'tokens/s':>9} {'latency s':>10} {'ratio':>6}")
    print(f"{f'HF generate, num_return_sequences={args.requests} (reference)':<58} {hf_one:9.1f} {'':>10} {1.0:6.2f}")
    print(f"{f'bios, one request of {len(one_prompt)} tokens, {args.requests} samples':<58} {bios_one:9.1f} {'':>10} "
          f"{bios_one / hf_one:6.2f}   rounds: " + " ".join(f"{b / h:.2f}" for b, h in zip(bios_rates, hf_rates)))
    print(f"{f'ceiling: the weight matmuls of a step alone, {floor * 1e3:.0f} ms':<58} {args.requests / floor:9.1f} "
          f"{'':>10} {args.requests / floor / hf_one:6.2f}")
    print(f"{'HF generate, sequential (reference)':<58} {ref_rate:9.1f} {ref_latency:10.3f} {1.0:6.2f}")
    print(f"{'bios, concurrent requests batched':<58} {rate:9.1f} {'':>10} {rate / ref_rate:6.2f}")
    print(f"{'bios, one request alone (latency ratio)':<58} {'':>9} {latency:10.3f} {latency / ref_latency:6.2f}")
    print(f"\n(after the run) {describe_machine()}")


if __name__ == "__main__":
    main()
