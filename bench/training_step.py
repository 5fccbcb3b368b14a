"""One whole LoRA training step: Bios's engine with `bios.kernels` against stock Transformers + PEFT.

    python bench/training_step.py [--model smollm2] [--batch 4] [--seq 128] [--rank 16] [--rounds 7]
                                  [--memory-runs 3] [--configs peft,bios-stock,bios-fp32,bios] [--mixed]

A step is forward, backward of the summed next-token cross-entropy and one AdamW update, on `batch` random
sequences of `seq` tokens (with `--mixed`: of seeded random lengths from `seq`/4 to `seq`, as SFT and RL batches
are; PEFT pads them to the longest with an attention mask and -100 labels, as a hand-written loop does, and
Bios packs them), LoRA of rank `rank` on every linear layer including the output head. tokens/s and MFU count
real tokens only. Configurations:

- `peft` (the reference): `peft.get_peft_model` on the Transformers model, `model(input_ids, labels=...).loss`,
  `loss.backward()`, `torch.optim.AdamW(foreach=True)` (dropout 0, no KV cache);
- `bios-stock`: Bios's engine (`forward_backward`, `commit_gradients`, `optim_step`) with `BIOS_KERNELS=0`
  and `BIOS_BASE_DTYPE=float32`;
- `bios-fp32`: the same with `bios.kernels`;
- `bios`: the worker's defaults: `bios.kernels`, `BIOS_BASE_DTYPE` unset, so the frozen base weights (and
  activations) are bf16 where the hardware multiplies bf16 natively and fp32 elsewhere (printed in the
  header); LoRA factors, gradients and optimizer state are fp32 either way;
- `peft-bf16`: the model loaded in bf16 (PEFT keeps its adapter in fp32 too, `autocast_adapter_dtype`);
- `bios-fp32-padded`, `bios-padded`: `bios-fp32` and `bios` with `BIOS_PACKING=0` (rows padded to the
  longest, as before packing): with `--mixed`, what packing gains in the same run.

Peak memory: each configuration runs three steps in a fresh subprocess, `--memory-runs` times (median); peak
extra = RSS high-water mark (reset through `/proc/self/clear_refs`) above the RSS once the base model (its
weights paged in) and the batch exist, so it counts the adapter, its gradients, the optimizer state and every
activation (`max_memory_allocated` on CUDA). The allocator makes one run's peak vary by ~10%. Time: one more
subprocess holds every configuration and runs their steps round-robin after a warm-up step each, so load from
other processes falls on all of them alike; the median step time gives tokens/s. The table divides by `peft`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bios import types  # noqa: E402
from bios.models import load_base_model, resolve_model_dir  # noqa: E402
from bios.worker.adapter import LORA_ALPHA, AdapterState, lora_targets  # noqa: E402
from bios.worker.compute_mode import base_dtype  # noqa: E402
from bios.worker.engine import ForwardItem, commit_gradients, forward_backward, optim_step  # noqa: E402
from bios.worker.lora import attach_lora  # noqa: E402
from flops import gemm_peak, training_step_flops  # noqa: E402
from machine import describe_machine  # noqa: E402
from peak_memory import PeakMemory  # noqa: E402
from training_throughput import make_batch  # noqa: E402

CONFIGS = ("peft", "bios-stock", "bios-fp32", "bios", "peft-bf16", "bios-fp32-padded", "bios-padded")
TARGETS = {"bios": {"tokens/s": 1.25, "memory": 0.6}}  # tokens/s at least, memory at most, x peft
ADAM = types.AdamParams(learning_rate=1e-4)


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _load(config: str, args: argparse.Namespace):
    """The base model as each side runs it: PEFT loads in the dtype; Bios loads as its workers do (float32,
    then `attach_lora` applies `BIOS_BASE_DTYPE`, or its hardware-dependent default for `bios`)."""
    if config.startswith("peft"):
        dtype = torch.bfloat16 if config.endswith("-bf16") else torch.float32
        return load_base_model(args.model, device=_device(), dtype=dtype)
    loaded = load_base_model(args.model, device=_device())
    if config.removesuffix("-padded") == "bios":
        os.environ.pop("BIOS_BASE_DTYPE", None)
    else:
        os.environ["BIOS_BASE_DTYPE"] = "float32"
    attach_lora(loaded.model)
    return loaded


def row_lengths(args: argparse.Namespace) -> list[int]:
    """Every row `seq` long, or with `--mixed` seeded random lengths in [seq/4, seq]."""
    if not args.mixed:
        return [args.seq] * args.batch
    generator = torch.Generator().manual_seed(1)
    return torch.randint(args.seq // 4, args.seq + 1, (args.batch,), generator=generator).tolist()


def _step_fn(config: str, loaded, data: list[types.Datum], rank: int) -> Callable[[], None]:
    """Build the adapter (and optimizer) of `config` on `loaded.model`; return one training step."""
    model = loaded.model
    lora = types.LoraConfig(rank=rank, seed=0)
    if config.startswith("peft"):
        import peft

        modules = sorted({t.module_name.rsplit(".", 1)[-1] for t in lora_targets(model, lora)})
        peft_model = peft.get_peft_model(
            model, peft.LoraConfig(r=rank, lora_alpha=LORA_ALPHA, target_modules=modules, lora_dropout=0.0)
        )
        params = [p for p in peft_model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=ADAM.learning_rate, betas=(ADAM.beta1, ADAM.beta2), eps=ADAM.eps,
                                      weight_decay=ADAM.weight_decay, foreach=True)
        rows = [torch.tensor(d.model_input.to_ints()) for d in data]
        ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True).to(_device())
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(row) for row in rows], batch_first=True).to(ids.device)
        labels = ids.masked_fill(mask == 0, -100)

        def peft_step() -> None:
            peft_model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        return peft_step

    adapter = AdapterState.create("bench", model, lora, device=_device())
    kernels = "0" if config == "bios-stock" else "1"
    packing = "0" if config.endswith("-padded") else "1"

    def bios_step() -> None:
        os.environ["BIOS_KERNELS"] = kernels
        os.environ["BIOS_PACKING"] = packing
        forward_backward(model, [ForwardItem(adapter, data, "cross_entropy")])
        commit_gradients(adapter)
        optim_step(adapter, ADAM)

    return bios_step


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure_memory(config: str, args: argparse.Namespace) -> dict:
    """Peak extra memory of `config` over three steps (the first allocates the optimizer state)."""
    loaded = _load(config, args)
    data = make_batch(loaded.info.vocab_size, row_lengths(args))
    with torch.no_grad():  # page in weights still mapped from the safetensors file, so they are not counted
        for param in loaded.model.parameters():
            param.sum()
    peak = PeakMemory(_device())
    step = _step_fn(config, loaded, data, args.rank)
    for _ in range(3):
        step()
    return {"peak_extra_mib": peak.extra_mib()}


def measure_times(configs: list[str], args: argparse.Namespace) -> dict[str, list[float]]:
    """Step times of every configuration, their steps interleaved round-robin."""
    steps = {}
    for config in configs:
        loaded = _load(config, args)
        data = make_batch(loaded.info.vocab_size, row_lengths(args))
        steps[config] = _step_fn(config, loaded, data, args.rank)
        steps[config]()  # warm-up
    times: dict[str, list[float]] = {config: [] for config in configs}
    for _ in range(args.rounds):
        for config, step in steps.items():
            _sync()
            started = time.perf_counter()
            step()
            _sync()
            times[config].append(time.perf_counter() - started)
    return times


def _subprocess(flag: str, payload: object, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, flag, json.dumps(payload), "--model", args.model, "--batch",
               str(args.batch), "--seq", str(args.seq), "--rank", str(args.rank), "--rounds", str(args.rounds)]
    command += ["--mixed"] if args.mixed else []
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"benchmark subprocess {flag} {payload} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def default_base_dtype() -> str:
    """The frozen-base dtype the `bios` configuration gets here, and why."""
    saved = os.environ.pop("BIOS_BASE_DTYPE", None)
    try:
        choice = base_dtype(_device())
    finally:
        if saved is not None:
            os.environ["BIOS_BASE_DTYPE"] = saved
    return f"{str(choice.dtype or torch.float32).removeprefix('torch.')} ({choice.reason})"


def matmul_dtype(config: str) -> torch.dtype:
    """The dtype a configuration's frozen matmuls run in, whose GEMM peak its MFU is taken against."""
    if config.removesuffix("-padded") == "bios":
        saved = os.environ.pop("BIOS_BASE_DTYPE", None)
        try:
            return base_dtype(_device()).dtype or torch.float32
        finally:
            if saved is not None:
                os.environ["BIOS_BASE_DTYPE"] = saved
    return torch.bfloat16 if config.endswith("-bf16") else torch.float32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7, help="timed steps per configuration")
    parser.add_argument("--memory-runs", type=int, default=3, help="fresh subprocesses per configuration's peak")
    parser.add_argument("--configs", default=",".join(CONFIGS[:4]),
                        help=f"comma-separated, the first is the reference; from {', '.join(CONFIGS)}")
    parser.add_argument("--mixed", action="store_true", help="rows of random lengths from seq/4 to seq")
    parser.add_argument("--memory", help=argparse.SUPPRESS)  # internal: one configuration's memory run
    parser.add_argument("--timing", help=argparse.SUPPRESS)  # internal: every configuration's interleaved steps
    args = parser.parse_args()
    if args.memory:
        print(json.dumps(measure_memory(json.loads(args.memory), args)))
        return
    if args.timing:
        print(json.dumps(measure_times(json.loads(args.timing), args)))
        return
    configs = args.configs.split(",")
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configurations {unknown}; choose from {', '.join(CONFIGS)}")
    resolve_model_dir(args.model)  # pull or write the model once, outside the measurements
    print(describe_machine())
    lengths = row_lengths(args)
    print(f"model {args.model}, batch {args.batch}x{args.seq}" + (f" (rows of {lengths} tokens)" if args.mixed else "")
          + f", LoRA rank {args.rank} on every linear layer and "
          f"the head; {args.rounds} interleaved timed steps per configuration, medians")
    print(f"`bios` (the worker's default) stores the frozen base in {default_base_dtype()}", flush=True)
    memory = {
        config: statistics.median(
            _subprocess("--memory", config, args)["peak_extra_mib"] for _ in range(args.memory_runs)
        )
        for config in configs
    }
    steps = _subprocess("--timing", configs, args)
    times = {config: statistics.median(values) for config, values in steps.items()}
    tokens = sum(lengths)
    flops = training_step_flops(load_base_model(args.model).model, lengths, args.rank).total
    peaks = {dtype: gemm_peak(dtype, _device()) for dtype in {matmul_dtype(config) for config in configs}}
    print(f"{flops / 1e9:.0f} GFLOP of matmul per step (bench/flops.py); GEMM peak here, 2048^3 with "
          f"{torch.get_num_threads()} threads: " + ", ".join(f"{str(d).removeprefix('torch.')} {p / 1e9:.0f} GFLOP/s"
                                                          for d, p in peaks.items()))
    reference = configs[0]
    print(f"\n{'config':<16} {'median step':>11} {'(min-max)':>13} {'tokens/s':>9} {'x ' + reference:>8} "
          f"{'MFU':>5} {'peak extra':>11} {'x ' + reference:>8}  target")
    for config in configs:
        ratios = {"tokens/s": times[reference] / times[config], "memory": memory[config] / memory[reference]}
        verdicts = []
        for metric, limit in TARGETS.get(config, {}).items():
            met = ratios[metric] >= limit if metric == "tokens/s" else ratios[metric] <= limit
            verdicts.append(f"{metric} {'>=' if metric == 'tokens/s' else '<='}{limit}x {'met' if met else 'MISSED'}")
        spread = f"({min(steps[config]):.2f}-{max(steps[config]):.2f})"
        mfu = flops / times[config] / peaks[matmul_dtype(config)]
        print(f"{config:<16} {times[config]:>10.2f}s {spread:>13} {tokens / times[config]:>9.0f} "
              f"{ratios['tokens/s']:>7.2f}x {mfu:>5.0%} {memory[config]:>7.0f} MiB {ratios['memory']:>7.2f}x  "
              f"{', '.join(verdicts)}")
    print(f"\n(after the run) {describe_machine()}")


if __name__ == "__main__":
    main()
