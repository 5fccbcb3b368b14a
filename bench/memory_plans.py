"""Peak per-worker memory and step time of each memory plan, estimated (bios.models.memory_plan) and measured.

    python bench/memory_plans.py                              # SmolLM2-135M shape, 1024 tokens, every plan
    python bench/memory_plans.py --models smollm2,llama-1b --tokens 1024 --steps 3
    python bench/memory_plans.py --models llama-1b --tokens 256 --plans replicate,tp

Models are random-weight Llamas with the shapes of SmolLM2-135M and Llama-3.2-1B (nothing is downloaded).
Each plan runs in fresh processes (TP=k: k of them, joined by gloo through a FileStore): the model is built on the
meta device, split when tensor-parallel, then materialised, so the peak RSS is that of a worker holding only
its shard (as a sharded load would), not of a full load followed by a split. Every process runs one intra-op
thread: one worker per core. Each step is forward_backward + commit + AdamW over `--tokens` tokens in rows of
`--seq`; the step time is the fastest step after the first, over `--rounds` round-robin runs of all plans (the
peak is the highest). "vs replicate" divides by the replicate
plan's step time; TP=k uses k cores for it, so on this 2-core CPU it is a memory plan, not a speed-up. The
tensor-parallel plan uses the smallest size that splits the model: SmolLM2's 9 query / 3 key-value heads
split 3 ways, not 2.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from bios.models.memory_plan import TENSOR_PARALLEL_SIZES, GiB, ModelShape, estimate

MODELS = {
    "smollm2": dict(  # HuggingFaceTB/SmolLM2-135M
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, tie_word_embeddings=True, max_position_embeddings=8192,
    ),
    "llama-1b": dict(  # meta-llama/Llama-3.2-1B
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, max_position_embeddings=8192,
    ),
}
PLANS = {
    "replicate": dict(tp=1, dtype="float32", activation_checkpointing=False),
    "checkpointing": dict(tp=1, dtype="float32", activation_checkpointing=True),
    "bf16": dict(tp=1, dtype="bfloat16", activation_checkpointing=False),
    "tp": dict(tp=0, dtype="float32", activation_checkpointing=False),  # the smallest size that splits the model
}
RANK = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2")
    parser.add_argument("--plans", default=",".join(PLANS))
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="runs of every plan; min step time, max peak")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe(json.loads(args.probe), args.rank, args.store)))
        return
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.1f}; LoRA rank {RANK} on every projection and the head; "
          f"{args.tokens} tokens per step in rows of {args.seq}; 1 thread per worker\n")
    for model in args.models.split(","):
        specs = {}
        for plan in args.plans.split(","):
            spec = {"model": model, **PLANS[plan], "tokens": args.tokens, "seq": args.seq, "steps": args.steps}
            if plan == "tp":
                shape = ModelShape.from_config(LlamaConfig(**MODELS[model]))
                spec["tp"] = next(k for k in TENSOR_PARALLEL_SIZES if shape.tensor_parallel_problem(k) is None)
                plan = f"tp{spec['tp']}"
            specs[plan] = spec
        measured: dict[str, list[tuple[int, float]]] = {plan: [] for plan in specs}
        for _ in range(args.rounds):  # round-robin, so load from other jobs falls on every plan alike
            for plan, spec in specs.items():
                results = run_plan(spec)
                measured[plan].append((max(r["peak"] for r in results), max(r["step_s"] for r in results)))
                print(f"  {model} {plan}: {measured[plan][-1][0] / GiB:.2f} GiB, {measured[plan][-1][1]:.2f} s/step",
                      flush=True)
        rows = []
        for plan, spec in specs.items():
            predicted = estimate(LlamaConfig(**MODELS[model]), lora_rank=RANK, batch_tokens=args.tokens,
                                 dtype=spec["dtype"], activation_checkpointing=spec["activation_checkpointing"],
                                 tp=spec["tp"])
            print(f"  {model} {plan}: estimated {predicted.describe()}")
            peak = max(peak for peak, _ in measured[plan])
            step = min(step for _, step in measured[plan])
            rows.append((plan, predicted.total, peak, step))
        print_table(model, rows)


def print_table(model: str, rows: list[tuple[str, int, int, float]]) -> None:
    reference = next((step for plan, *_, step in rows if plan == "replicate"), None)
    print(f"\n{model} ({args_summary(model)})\n")
    print("| plan | estimated peak / worker | measured peak / worker | estimate / measured | step time | vs replicate |")
    print("|---|---|---|---|---|---|")
    for plan, predicted, peak, step in rows:
        relative = f"{step / reference:.2f}x" if reference else "-"
        print(f"| {plan} | {predicted / GiB:.2f} GiB | {peak / GiB:.2f} GiB | {predicted / peak:.2f} | {step:.2f} s | "
              f"{relative} |")
    print(flush=True)


def args_summary(model: str) -> str:
    config = MODELS[model]
    return (f"{config['num_hidden_layers']} layers, hidden {config['hidden_size']}, MLP {config['intermediate_size']}, "
            f"{config['num_attention_heads']}/{config['num_key_value_heads']} heads, vocab {config['vocab_size']}")


def run_plan(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The plan's processes (one per tensor-parallel rank), run to completion; their reports."""
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        processes = [
            subprocess.Popen(
                [sys.executable, __file__, "--probe", json.dumps(spec), "--rank", str(rank), "--store", store],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            for rank in range(spec["tp"])
        ]
        reports = []
        for process in processes:
            out, err = process.communicate()
            if process.returncode != 0:
                raise RuntimeError(f"probe {spec} failed:\n{err[-3000:]}")
            reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def probe(spec: dict[str, Any], rank: int, store: str | None) -> dict[str, Any]:
    """One worker of the plan: build (its shard of) the model, train `steps` steps, report peak RSS and time."""
    import torch.distributed as dist

    from bios.types import AdamParams, Datum, LoraConfig, ModelInput
    from bios.worker.adapter import AdapterState
    from bios.worker.engine import ForwardItem, commit_gradients, forward_backward, optim_step
    from bios.worker.lora import attach_lora
    from bios.worker.memory_plan import enable_activation_checkpointing, peak_rss
    from bios.worker import tensor_parallel as tp
    from bios.worker.sharded_adapter import create_sharded_adapter

    torch.set_num_threads(1)
    world = spec["tp"]
    if world > 1:
        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    config = LlamaConfig(**MODELS[spec["model"]])
    dtype = getattr(torch, spec["dtype"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    attach_lora(model)
    info = tp.shard_model(model, rank, world) if world > 1 else None
    materialise(model)
    if spec["activation_checkpointing"]:
        enable_activation_checkpointing(model)
    lora = LoraConfig(rank=RANK, seed=0)
    if info is None:
        adapter = AdapterState.create("bench", model, lora, device="cpu")
    else:
        adapter = create_sharded_adapter("bench", model, lora, seed=0, device="cpu")
    generator = torch.Generator().manual_seed(0)
    data = []
    for _ in range(spec["tokens"] // spec["seq"]):
        tokens = torch.randint(0, config.vocab_size, (spec["seq"] + 1,), generator=generator)
        data.append(Datum(ModelInput.from_ints(tokens[:-1].tolist()),
                          {"target_tokens": tokens[1:], "weights": torch.ones(spec["seq"])}))
    times = []
    for _ in range(spec["steps"]):
        started = time.perf_counter()
        forward_backward(model, [ForwardItem(adapter, data, "cross_entropy")])
        if info is None:
            commit_gradients(adapter)
            optim_step(adapter, AdamParams(learning_rate=1e-4))
        else:
            tp.reduce_shared_grads(adapter, info)
            tp.commit_sharded_gradients(adapter, info)
            tp.sharded_optim_step(adapter, AdamParams(learning_rate=1e-4), info)
        times.append(time.perf_counter() - started)
    if world > 1:
        dist.destroy_process_group()
    return {"peak": peak_rss(), "step_s": min(times[1:] or times)}


@torch.no_grad()
def materialise(model: torch.nn.Module) -> None:
    """Real CPU memory for a meta-device model: small uniform weights, unit norms, rotary tables recomputed."""
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives every module its own new parameter, untying a shared head
    for name, param in model.named_parameters():
        if param.ndim == 1:
            param.fill_(1.0)
        else:
            param.uniform_(-0.02, 0.02)
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding"):
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, type(module)(config=module.config))


if __name__ == "__main__":
    main()
