"""How many aten ops one LoRA training step dispatches: the host's share of a GPU step is one launch per op.

    python bench/op_count.py [--layers 30] [--batch 4] [--seq 128] [--rank 16] [--c-kernels both|off|auto]
                             [--top 25] [--save counts.json] [--before counts.json]

`--save` writes the raw counts (every op by name, per setting); `--before` reads such a file (say, saved at an
earlier commit) and puts its counts beside this run's, column by column, with the change.

A step is Bios's engine as the worker runs it (`forward_backward` of the summed next-token cross-entropy,
`commit_gradients`, `optim_step`), `BIOS_BASE_DTYPE=float32`, LoRA of rank `rank` on every linear layer and the
head, on a SmolLM2-135M-shaped model with random weights built from its config (no download; `--layers 30` is
the real depth) and `batch` random rows of `seq` tokens. The second step is counted (the first allocates the
optimizer state). A `TorchDispatchMode` sees every aten op below autograd, so the forward, autograd's backward
and the optimizer alike; the table splits them into

- compute ops: each launches (at least) one kernel on CUDA: products, elementwise ops, copies, reductions,
  fills (`zeros`), the C kernels' custom ops;
- view and allocation ops (`view`, `t`, `slice`, `as_strided`, `empty`, `detach`, ...): metadata only, no
  kernel, but each still costs the host a dispatch (~1-3 us).

With `BIOS_C_KERNELS=off` the step takes the PyTorch-op path a CUDA device takes (Bios's C kernels are CPU-only),
so its compute ops are what a GPU step launches, give or take the CUDA-only routes (grouped GEMMs for experts,
SDPA's fused kernels); `auto` (C kernels on) is the CPU's own path, for reference. Counts, never times: the
same on any machine, so before/after comparisons need no alternating rounds.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Ops that only make a view, alias or uninitialised buffer: no kernel on any device.
NO_KERNEL = frozenset({
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "slice", "select", "as_strided",
    "detach", "alias", "unsqueeze", "squeeze", "split", "split_with_sizes", "unbind", "chunk", "narrow",
    "unflatten", "flatten", "view_as", "diagonal", "empty", "empty_like", "empty_strided", "new_empty",
    "new_empty_strided", "lift_fresh", "_reshape_alias", "unfold", "_local_scalar_dense", "is_same_size",
    "resize_", "set_", "_has_compatible_shallow_copy_type", "sym_size", "sym_stride", "sym_numel", "dim",
    "is_contiguous", "size", "stride", "numel", "storage_offset", "promote_types",
})


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active, by name (`mm`, `addmm_`, `mul`; overloads merged)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        name = name if func.namespace == "aten" else f"{func.namespace}::{name}"
        self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def split_counts(counts: collections.Counter[str]) -> tuple[dict[str, int], dict[str, int]]:
    """(compute ops, view and allocation ops), each by name."""
    compute = {name: n for name, n in counts.items() if name not in NO_KERNEL}
    views = {name: n for name, n in counts.items() if name in NO_KERNEL}
    return compute, views


def smollm2_shaped(layers: int):
    """SmolLM2-135M's widths, heads, vocabulary and tied head with random weights (tests/test_kernel_integration.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, max_position_embeddings=2048)
    return LlamaForCausalLM(config).eval()


def count_step(args: argparse.Namespace) -> collections.Counter[str]:
    """The ops of one Bios training step (the second), in this process's `BIOS_C_KERNELS` setting."""
    from bios import types
    from bios.worker.adapter import AdapterState
    from bios.worker.engine import (
        ForwardItem,
        commit_gradients,
        forward_backward,
        optim_step,
    )

    os.environ["BIOS_BASE_DTYPE"] = "float32"
    model = smollm2_shaped(args.layers)
    generator = torch.Generator().manual_seed(0)
    data = []
    for _ in range(args.batch):
        tokens = torch.randint(0, model.config.vocab_size, (args.seq + 1,), generator=generator).tolist()
        data.append(types.Datum(types.ModelInput.from_ints(tokens[:-1]),
                                {"target_tokens": tokens[1:], "weights": [1.0] * args.seq}))
    adapter = AdapterState.create("ops", model, types.LoraConfig(rank=args.rank, seed=0), device="cpu")
    adam = types.AdamParams(learning_rate=1e-4)

    def step() -> None:
        forward_backward(model, [ForwardItem(adapter, data, "cross_entropy")])
        commit_gradients(adapter)
        optim_step(adapter, adam)

    step()
    counter = OpCounter()
    with counter:
        step()
    return counter.counts


def _child(setting: str, args: argparse.Namespace) -> dict[str, int]:
    """Counts in a fresh process with `BIOS_C_KERNELS=setting` (the setting is read once per process)."""
    import subprocess

    env = dict(os.environ, BIOS_C_KERNELS=setting)
    command = [sys.executable, __file__, "--child", "--layers", str(args.layers), "--batch", str(args.batch),
               "--seq", str(args.seq), "--rank", str(args.rank)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"op_count child BIOS_C_KERNELS={setting} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def print_table(results: dict[str, dict[str, int]], top: int) -> None:
    """One table per kind of op (compute, view/allocation): a row per op name, a column per result."""
    columns = list(results)
    split = {c: split_counts(collections.Counter(results[c])) for c in columns}
    for part, title in ((0, "compute ops (a kernel each on CUDA)"), (1, "view and allocation ops (no kernel)")):
        totals: collections.Counter[str] = collections.Counter()
        for c in columns:
            totals.update(split[c][part])
        names = [name for name, _ in totals.most_common()]
        print(f"| {title} | " + " | ".join(columns) + " |")
        print("|---|" + "---:|" * len(columns))
        for name in names[:top]:
            print(f"| {name} | " + " | ".join(str(split[c][part].get(name, 0)) for c in columns) + " |")
        if len(names) > top:
            rest = names[top:]
            print(f"| ({len(rest)} others) | "
                  + " | ".join(str(sum(split[c][part].get(n, 0) for n in rest)) for c in columns) + " |")
        print("| **total** | " + " | ".join(f"**{sum(split[c][part].values())}**" for c in columns) + " |")
        print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2-135M has 30)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--c-kernels", default="both", choices=("both", "off", "auto"))
    parser.add_argument("--top", type=int, default=25, help="rows of each table (the rest summed)")
    parser.add_argument("--save", help="write the raw counts here (JSON)")
    parser.add_argument("--before", help="counts saved earlier with --save, shown beside this run's")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(dict(count_step(args))))
        return
    settings = ["off", "auto"] if args.c_kernels == "both" else [args.c_kernels]
    results = {s: _child(s, args) for s in settings}
    if args.save:
        Path(args.save).write_text(json.dumps(results, sort_keys=True, indent=1))
    print(f"# one training step: SmolLM2-135M-shaped, {args.layers} layers, {args.batch} x {args.seq} tokens, "
          f"LoRA rank {args.rank} on every linear layer and the head, fp32; torch {torch.__version__}")
    print()
    columns = {}
    before = json.loads(Path(args.before).read_text()) if args.before else {}
    for s in settings:
        if s in before:
            columns[f"C {s}: before"] = before[s]
            columns[f"C {s}: after"] = results[s]
            change = collections.Counter(results[s])
            change.subtract(before[s])
            columns[f"C {s}: change"] = {name: n for name, n in change.items() if n}
        else:
            columns[f"BIOS_C_KERNELS={s}"] = results[s]
    print_table(columns, args.top)


if __name__ == "__main__":
    main()
