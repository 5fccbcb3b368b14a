"""Where one training step's time goes: Bios's engine in-process (no cluster) against the PEFT loop, with the
torch profiler's top operators and the number of kernel launches.

    python bench/profile_step.py --shape smollm2 --batch 8 --seq 1024          # on a GPU machine
    python bench/profile_step.py --device cpu --shape tiny --batch 2 --seq 64  # a dry run

Rows: `peft` (bench/gpu_check.py's reference loop), `bios` (the worker's defaults, one pass over the batch),
`bios-pass=N` (micro-batches of at most N tokens, as a memory plan may choose), `bios-stock` (`BIOS_KERNELS=0`).
A step is forward_backward + commit + AdamW; times are medians of `--steps` synchronized steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import SHAPES, PeftLoop, sync, write_model  # noqa: E402
from training_throughput import make_batch  # noqa: E402

from bios import types  # noqa: E402
from bios.models import load_base_model  # noqa: E402
from bios.worker.adapter import AdapterState  # noqa: E402
from bios.worker.engine import ForwardItem, commit_gradients, forward_backward, optim_step  # noqa: E402
from bios.worker.lora import attach_lora  # noqa: E402

ADAM = types.AdamParams(learning_rate=1e-4)


def bios_step_fn(model_dir: Path, data: list[types.Datum], rank: int, device: torch.device, tokens_per_pass: int,
                 kernels: str):
    loaded = load_base_model(str(model_dir), device=device)
    attach_lora(loaded.model)
    adapter = AdapterState.create("profile", loaded.model, types.LoraConfig(rank=rank, seed=0), device=device)

    def step() -> None:
        os.environ["BIOS_KERNELS"] = kernels
        forward_backward(loaded.model, [ForwardItem(adapter, data, "cross_entropy")],
                         max_tokens_per_pass=tokens_per_pass)
        commit_gradients(adapter)
        optim_step(adapter, ADAM)

    return step


def median_time(step, steps: int, device: torch.device) -> float:
    times = []
    for _ in range(steps):
        sync(device)
        started = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--passes", default="4096", help="comma-separated micro-batch budgets to time too")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/bios-profile-models"))
    args = parser.parse_args()
    device = torch.device(args.device)
    model_dir = write_model(args.shape, args.model_dir, device)
    data = make_batch(SHAPES[args.shape]["vocab_size"], [args.seq] * args.batch)
    whole = args.batch * args.seq
    peft_loop = PeftLoop(model_dir, data, args.rank, device)
    steps = {"peft": peft_loop.step, "bios": bios_step_fn(model_dir, data, args.rank, device, whole, "1")}
    for budget in filter(None, args.passes.split(",")):
        steps[f"bios-pass={budget}"] = bios_step_fn(model_dir, data, args.rank, device, int(budget), "1")
    steps["bios-stock"] = bios_step_fn(model_dir, data, args.rank, device, whole, "0")
    for step in steps.values():
        step()
    times = {name: median_time(step, args.steps, device) for name, step in steps.items()}
    for name in ("peft", "bios"):
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            steps[name]()
            sync(device)
        events = prof.key_averages()
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC"))
        print(f"\n== {name}: {launches} kernel launches in one step")
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(events.table(sort_by=sort, row_limit=args.top, max_name_column_width=60))
    print(f"\n{args.shape}, batch {args.batch}x{args.seq}, rank {args.rank}, device {device}")
    for name, seconds in times.items():
        print(f"{name:<18} {seconds * 1e3:9.1f} ms/step  {whole / seconds:9.0f} tok/s  "
              f"{times['peft'] / seconds:5.2f}x peft")


if __name__ == "__main__":
    main()
