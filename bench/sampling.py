"""Sampling throughput: 16 concurrent `sample` requests through the cluster (batched by the worker) vs 16
sequential Hugging Face `generate` calls in one process; and single-request latency vs one `generate`.

    python bench/sampling.py [--model smollm2] [--requests 16] [--tokens 64]

Both sides sample at temperature 1 with a KV cache and never stop early (`stop=[]` / no EOS), so they produce
the same number of tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import time

import torch

import bios
from bios import types
from bios.models import load_base_model, resolve_model_dir

PROMPTS = [f"Question {i}: tell me something about the number {i * 7}." for i in range(64)]


def hf_generate(model_name: str, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """(tokens/s over sequential calls, median single-call latency)."""
    loaded = load_base_model(model_name)
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    resolve_model_dir(args.model)
    tokenizer = load_base_model(args.model).tokenizer
    prompts = [tokenizer.encode(p) for p in PROMPTS[: args.requests]]
    ref_rate, ref_latency = hf_generate(args.model, prompts, args.tokens)
    rate, latency = asyncio.run(bios_sample(args.model, prompts, args.tokens))
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"model {args.model}: {args.requests} requests x {args.tokens} new tokens, temperature 1")
    print(f"{'':<48} {'tokens/s':>9} {'latency s':>10} {'ratio':>6}")
    print(f"{'HF generate, sequential (reference)':<48} {ref_rate:9.1f} {ref_latency:10.3f} {1.0:6.2f}")
    print(f"{'bios, concurrent requests batched':<48} {rate:9.1f} {'':>10} {rate / ref_rate:6.2f}")
    print(f"{'bios, one request alone (latency ratio)':<48} {'':>9} {latency:10.3f} {latency / ref_latency:6.2f}")


if __name__ == "__main__":
    main()
