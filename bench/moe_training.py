"""A MoE LoRA training step: Bios's per-expert LoRA on grouped tokens against PEFT's `target_parameters`.

    python bench/moe_training.py [--hidden 512] [--experts 16] [--top-k 4] [--layers 4] [--expert-width 512]
                                 [--rank 16] [--batch 4] [--seq 256] [--rounds 5] [--memory-runs 3]

A Qwen3-MoE-shaped model (random weights, fp32, built in-process from a config) with LoRA of rank `rank` on
the attention projections, every routed expert's `gate_up_proj` and `down_proj`, and the output head. A step
is forward, backward of the next-token cross-entropy and one AdamW update on `batch` random sequences of `seq`
tokens:

- `peft` (the reference): `peft.get_peft_model` with `target_modules` (attention, head) and `target_parameters`
  (the experts' 3D weights), `torch.optim.AdamW(foreach=True)`. PEFT folds each adapted expert weight into a
  `W + scale * B A` copy on every forward (`ParamWrapper`);
- `bios`: Bios's engine (`forward_backward`, `commit_gradients`, `optim_step`), fp32 base, kernels on: tokens
  grouped by expert, each expert's LoRA applied as two rank-sized matmuls (`bios.kernels.expert_lora`); a MoE
  layer keeps its tokens, the gate_up output and the experts' outputs for backward (not the sorted copy of
  the tokens, the gate's output or the routing-weighted outputs).

Peak memory: three steps in a fresh subprocess per configuration, `--memory-runs` times (median), RSS (CPU)
or allocator (CUDA) high-water mark above the level once the model and batch exist. Time: one subprocess
holds both and alternates their steps after a warm-up each; medians give tokens/s.
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
os.environ["BIOS_BASE_DTYPE"] = "float32"

from bios import types  # noqa: E402
from bios.models.catalog import BUILTIN_VOCAB_SIZE  # noqa: E402
from bios.worker.adapter import LORA_ALPHA, AdapterState, lora_targets  # noqa: E402
from bios.worker.engine import ForwardItem, commit_gradients, forward_backward, optim_step  # noqa: E402
from bios.worker.lora import attach_lora  # noqa: E402
from machine import describe_machine  # noqa: E402
from peak_memory import PeakMemory  # noqa: E402

CONFIGS = ("peft", "bios")
TARGETS = {"tokens/s": 1.5, "memory": 0.6}  # Bios vs PEFT: tokens/s at least, peak memory at most
ADAM = types.AdamParams(learning_rate=1e-4)


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _model(args: argparse.Namespace):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=BUILTIN_VOCAB_SIZE, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.expert_width, num_experts=args.experts, num_experts_per_tok=args.top_k,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8,
        max_position_embeddings=max(1024, args.seq), tie_word_embeddings=False, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(_device()).eval()
    model.requires_grad_(False)
    return model


def _batch(args: argparse.Namespace) -> list[types.Datum]:
    generator = torch.Generator().manual_seed(1)
    data = []
    for _ in range(args.batch):
        tokens = torch.randint(0, 256, (args.seq + 1,), generator=generator).tolist()
        inputs = {"target_tokens": tokens[1:], "weights": [1.0] * args.seq}
        data.append(types.Datum(types.ModelInput.from_ints(tokens[:-1]), inputs))
    return data


def _step_fn(config: str, model, data: list[types.Datum], rank: int) -> Callable[[], None]:
    lora = types.LoraConfig(rank=rank, seed=0, train_mlp=True, train_attn=True, train_unembed=True)
    if config == "peft":
        import peft

        targets = lora_targets(model, lora)  # the same targets Bios trains, on the stock model
        peft_model = peft.get_peft_model(model, peft.LoraConfig(
            r=rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
            target_modules=[t.module_name for t in targets if t.kind != "experts"],
            target_parameters=[t.module_name for t in targets if t.kind == "experts"],
        ))
        params = [p for p in peft_model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=ADAM.learning_rate, betas=(ADAM.beta1, ADAM.beta2), eps=ADAM.eps,
                                      weight_decay=ADAM.weight_decay, foreach=True)
        ids = torch.tensor([d.model_input.to_ints() for d in data], device=_device())

        def peft_step() -> None:
            peft_model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        return peft_step

    attach_lora(model)
    adapter = AdapterState.create("bench", model, lora, device=_device())

    def bios_step() -> None:
        forward_backward(model, [ForwardItem(adapter, data, "cross_entropy")])
        commit_gradients(adapter)
        optim_step(adapter, ADAM)

    return bios_step


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure_memory(config: str, args: argparse.Namespace) -> dict:
    model, data = _model(args), _batch(args)
    peak = PeakMemory(_device())
    step = _step_fn(config, model, data, args.rank)
    for _ in range(3):
        step()
    return {"peak_extra_mib": peak.extra_mib()}


def measure_times(args: argparse.Namespace) -> dict[str, list[float]]:
    steps = {}
    for config in CONFIGS:
        steps[config] = _step_fn(config, _model(args), _batch(args), args.rank)
        steps[config]()  # warm-up
    times: dict[str, list[float]] = {config: [] for config in CONFIGS}
    for _ in range(args.rounds):
        for config, step in steps.items():
            _sync()
            started = time.perf_counter()
            step()
            _sync()
            times[config].append(time.perf_counter() - started)
    return times


def _subprocess(flag: str, payload: object, argv: list[str]) -> dict:
    command = [sys.executable, __file__, *argv, flag, json.dumps(payload)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"benchmark subprocess {flag} {payload} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("hidden", 512), ("experts", 16), ("top-k", 4), ("layers", 4), ("expert-width", 512),
                          ("rank", 16), ("batch", 4), ("seq", 256), ("rounds", 5), ("memory-runs", 3)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--memory", help=argparse.SUPPRESS)  # internal: one configuration's memory run
    parser.add_argument("--timing", help=argparse.SUPPRESS)  # internal: the interleaved timed steps
    args = parser.parse_args()
    if args.memory:
        print(json.dumps(measure_memory(json.loads(args.memory), args)))
        return
    if args.timing:
        print(json.dumps(measure_times(args)))
        return
    argv = sys.argv[1:]
    print(describe_machine())
    print(f"Qwen3-MoE shape: hidden {args.hidden}, {args.experts} experts of width {args.expert_width}, top-"
          f"{args.top_k}, {args.layers} layers; batch {args.batch}x{args.seq}, LoRA rank {args.rank}, fp32", flush=True)
    memory = {config: statistics.median(_subprocess("--memory", config, argv)["peak_extra_mib"]
                                        for _ in range(args.memory_runs)) for config in CONFIGS}
    times = _subprocess("--timing", "all", argv)
    tokens = args.batch * args.seq
    rate = {config: tokens / statistics.median(times[config]) for config in CONFIGS}
    print("| config | tokens/s | x peft | peak extra MiB | x peft |")
    print("|---|---|---|---|---|")
    for config in CONFIGS:
        print(f"| {config} | {rate[config]:.0f} | {rate[config] / rate['peft']:.2f} | {memory[config]:.0f} | "
              f"{memory[config] / memory['peft']:.2f} |")
    print(f"targets: bios >= {TARGETS['tokens/s']}x tokens/s, <= {TARGETS['memory']}x peak memory")


if __name__ == "__main__":
    main()
