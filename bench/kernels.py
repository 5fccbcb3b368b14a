"""Benchmark bios.kernels against the ops they replace, measured in the same run.

    python bench/kernels.py [--quick] [--only ce,lora,norms,adamw]

Peak memory: every implementation runs once in a fresh subprocess; peak extra = RSS high-water mark above
the RSS after the inputs were built (Linux `/proc/self/clear_refs` resets the mark), or
`torch.cuda.max_memory_allocated` on GPU. LoRA and norm rows also give the bytes autograd keeps for backward
(unique storages seen by `saved_tensors_hooks`, parameters excluded). Time: one more subprocess per group runs its
implementations round-robin (a warm-up round, then `rounds` rounds) and reports each one's median, so load
from other processes hits reference and candidate alike; the huge V=128256 group skips the warm-up (and in
--quick mode uses the time of the memory run). The table gives ratios against the group's first row;
absolute times on shared CPUs are noise, ratios are the result.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bios.kernels import linear_cross_entropy, lora_linear, rms_norm, swiglu  # noqa: E402
from bios.kernels.cross_entropy import default_chunk_size  # noqa: E402
from machine import describe_machine  # noqa: E402
from peak_memory import MIB, PeakMemory  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Group:
    """Implementations of one op on the same inputs; `impls[0]` is the reference the others are divided by."""

    title: str
    op: str
    impls: list[str]
    shape: dict[str, int]
    dtype: str = "float32"
    rounds: int = 3
    warmup: bool = True
    targets: dict[str, float] = field(default_factory=dict)  # metric -> maximum ratio vs the reference


@dataclass(frozen=True)
class Measurement:
    time_s: float
    peak_extra_mib: float
    saved_mib: float | None = None


# ------------------------------------------------------------------------------------------- one config


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _saved_mib(run, exclude: list[torch.Tensor]) -> float:
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run(backward=False)
    return sum(storages.values()) / MIB


def _ce_step(group: Group, impl: str, device: torch.device):
    n, h, v = group.shape["n"], group.shape["h"], group.shape["v"]
    dtype = DTYPES[group.dtype]
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen).to(device, dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) / h**0.5).to(device, dtype)
    targets = torch.randint(0, v, (n,), generator=gen).to(device)
    chunk = default_chunk_size(v)
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=chunk) if impl == "torch_chunked" else None

    def logprobs():
        if impl.startswith("naive"):
            return torch.log_softmax((hidden @ weight.T).float(), -1).gather(1, targets[:, None]).squeeze(1)
        if impl == "torch_chunked":
            return -F.linear_cross_entropy(hidden, weight, targets, reduction="none", options=options)
        return linear_cross_entropy(hidden, weight, targets)

    def run(backward: bool = True):
        if impl.endswith("_fwd"):
            with torch.no_grad():
                logprobs()
            return
        hidden.grad = None
        out = logprobs()
        if backward:
            out.sum().backward()

    return run, [weight]


def _lora_step(group: Group, impl: str, device: torch.device):
    from peft import LoraConfig
    from peft.tuners.lora import Linear as PeftLoraLinear

    t, d, r = group.shape["tokens"], group.shape["dim"], group.shape["rank"]
    dtype = DTYPES[group.dtype]
    torch.manual_seed(0)
    base = torch.nn.Linear(d, d, bias=False).to(device, dtype).requires_grad_(False)
    dropout = 0.05 if impl == "peft_dropout" else 0.0
    layer = PeftLoraLinear(
        base, "default", config=LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=dropout),
        r=r, lora_alpha=2 * r, lora_dropout=dropout,
    ).to(device, dtype)
    layer.train()
    lora_a, lora_b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    with torch.no_grad():
        lora_b.normal_()
    x = torch.randn(t, d, device=device, dtype=dtype, requires_grad=True)
    grad_y = torch.randn(t, d, device=device, dtype=dtype)

    def run(backward: bool = True):
        x.grad = lora_a.grad = lora_b.grad = None
        if impl.startswith("peft"):
            y = layer(x)
        else:
            y = lora_linear(x, base.weight, None, lora_a, lora_b, 2.0)
        if backward:
            y.backward(grad_y)

    return run, [base.weight, lora_a, lora_b]


def _norm_step(group: Group, impl: str, device: torch.device):
    """rms_norm over [tokens, dim] or swiglu over two [tokens, dim] inputs, fwd+bwd."""
    t, d = group.shape["tokens"], group.shape["dim"]
    dtype = DTYPES[group.dtype]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(t, d, generator=gen).to(device, dtype).requires_grad_()
    other = torch.randn(t, d, generator=gen).to(device, dtype).requires_grad_()
    weight = torch.randn(d, generator=gen).to(device, dtype).requires_grad_()
    grad_y = torch.randn(t, d, generator=gen).to(device, dtype)
    ops = {
        "F.rms_norm": lambda: F.rms_norm(x, (d,), weight, 1e-5),
        "bios_rms_norm": lambda: rms_norm(x, weight, 1e-5),
        "silu*up": lambda: F.silu(x) * other,
        "bios_swiglu": lambda: swiglu(x, other),
    }

    def run(backward: bool = True):
        x.grad = other.grad = weight.grad = None
        y = ops[impl]()
        if backward:
            y.backward(grad_y)

    return run, [weight]


SMOLLM2_135M = {"layers": 30, "hidden": 576, "intermediate": 1536, "kv": 192}


def _adapter_shapes(rank: int) -> list[tuple[int, int]]:
    """LoRA A and B shapes for every linear layer of SmolLM2-135M (q, k, v, o, gate, up, down)."""
    hid, inter, kv = SMOLLM2_135M["hidden"], SMOLLM2_135M["intermediate"], SMOLLM2_135M["kv"]
    projections = [(hid, hid), (hid, kv), (hid, kv), (hid, hid), (hid, inter), (hid, inter), (inter, hid)]
    shapes = []
    for _ in range(SMOLLM2_135M["layers"]):
        for in_features, out_features in projections:
            shapes += [(rank, in_features), (out_features, rank)]
    return shapes


def _adamw_step(group: Group, impl: str, device: torch.device):
    from bios.kernels.adamw import adamw_step

    shapes = _adapter_shapes(group.shape["rank"])
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=gen).to(device) * 0.01 for s in shapes]
    grads = [torch.randn(s, generator=gen).to(device) for s in shapes]
    # a global norm of 0.5 under a clip norm of 1.0: clipping is computed but leaves the gradient as it is, so
    # repeated steps never shrink it into denormals (which would time the FPU's slow path instead of the code)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    grads = [g * (0.5 / norm) for g in grads]
    hyper = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.01, "grad_clip_norm": 1.0}
    if impl == "bios":
        flat_params = torch.cat([v.flatten() for v in values])
        flat_grads = torch.cat([g.flatten() for g in grads])
        exp_avg, exp_avg_sq = torch.zeros_like(flat_params), torch.zeros_like(flat_params)
        step = 0

        def run(backward: bool = True):
            nonlocal step
            step += 1
            adamw_step(flat_params, flat_grads, exp_avg, exp_avg_sq, step=step, **hyper)

        return run, []
    params = [torch.nn.Parameter(v) for v in values]
    for p, g in zip(params, grads):
        p.grad = g
    optimizer = torch.optim.AdamW(
        params, lr=hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]), eps=hyper["eps"],
        weight_decay=hyper["weight_decay"], foreach=impl == "torch_foreach", fused=impl == "torch_fused",
    )

    def run(backward: bool = True):
        torch.nn.utils.clip_grad_norm_(params, hyper["grad_clip_norm"], foreach=True)
        optimizer.step()

    return run, []


STEPS = {"ce": _ce_step, "lora": _lora_step, "adamw": _adamw_step, "norms": _norm_step}


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def measure_memory(group: Group, impl: str) -> Measurement:
    """One fwd+bwd (or optimizer step) of `impl`; meant to run in a fresh process."""
    device = _device()
    run, params = STEPS[group.op](group, impl, device)
    saved = _saved_mib(run, params) if group.op in ("lora", "norms") else None
    peak = PeakMemory(device)
    _sync(device)
    start = time.perf_counter()
    run()
    _sync(device)
    return Measurement(time.perf_counter() - start, peak.extra_mib(), saved)


def measure_times(group: Group) -> dict[str, float]:
    """Median time per implementation, running them round-robin (after one warm-up round unless disabled)."""
    device = _device()
    runs = {impl: STEPS[group.op](group, impl, device)[0] for impl in group.impls}
    times: dict[str, list[float]] = {impl: [] for impl in group.impls}
    first_timed = 1 if group.warmup else 0
    for round_index in range(first_timed + group.rounds):
        for impl, run in runs.items():
            _sync(device)
            start = time.perf_counter()
            run()
            _sync(device)
            if round_index >= first_timed:
                times[impl].append(time.perf_counter() - start)
    return {impl: statistics.median(values) for impl, values in times.items()}


# ----------------------------------------------------------------------------------------------- driver


def groups(quick: bool, only: set[str]) -> list[Group]:
    # the CE targets are set for N=4096 (the naive op's memory grows with N), so --quick (N=1024) shows no verdict
    ce_targets = {} if quick else {"time": 1.0, "mem": 0.15}
    out: list[Group] = []
    if "ce" in only:
        n = 1024 if quick else 4096
        shape = {"n": n, "h": 576, "v": 49152}
        impls = ["naive", "bios"]
        if not quick and hasattr(torch.nn, "LinearCrossEntropyOptions"):  # torch's own chunked op, if this torch has it
            impls.append("torch_chunked")
        out.append(Group(f"linear_cross_entropy fwd+bwd N={n} H=576 V=49152", "ce", impls, shape,
                         rounds=2 if quick else 3, targets=ce_targets))
        out.append(Group(f"linear_cross_entropy fwd+bwd N={n} H=2048 V=128256", "ce", ["naive", "bios"],
                         {"n": n, "h": 2048, "v": 128256}, rounds=0 if quick else 1, warmup=False,
                         targets=ce_targets))
        if not quick:
            out.append(Group(f"linear_cross_entropy fwd+bwd bf16 N={n} H=576 V=49152", "ce", ["naive", "bios"],
                             shape, dtype="bfloat16", targets=ce_targets))
            out.append(Group(f"linear_cross_entropy no_grad N={n} H=576 V=49152", "ce", ["naive_fwd", "bios_fwd"],
                             shape, targets={"mem": 0.15}))
    if "lora" in only:
        for dim in [576] if quick else [576, 2048]:
            impls = ["peft", "bios"] if quick else ["peft", "bios", "peft_dropout"]
            out.append(Group(f"lora_linear fwd+bwd T=4096 in=out={dim} r=16", "lora", impls,
                             {"tokens": 4096, "dim": dim, "rank": 16}, rounds=10 if quick else 20,
                             targets={"time": 0.9, "saved": 0.7}))
    if "norms" in only:
        shape = {"tokens": 4096, "dim": 1536}
        rounds = 10 if quick else 30
        for title, impls in [("rms_norm", ["F.rms_norm", "bios_rms_norm"]), ("swiglu", ["silu*up", "bios_swiglu"])]:
            out.append(Group(f"{title} fwd+bwd [4096, 1536]", "norms", impls, shape, rounds=rounds))
    if "adamw" in only:
        impls = ["torch_foreach", "bios"] if quick else ["torch_foreach", "bios", "torch_fused"]
        out.append(Group("adamw + clip_grad_norm_ step, rank-16 SmolLM2-135M adapter (4.9M params)", "adamw", impls,
                         {"rank": 16}, rounds=10 if quick else 30, targets={"time": 1.0}))
    return out


def _subprocess(flag: str, payload: dict) -> dict:
    result = subprocess.run(
        [sys.executable, __file__, flag, json.dumps(payload)], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"benchmark subprocess {flag} {payload} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_group(group: Group) -> dict[str, Measurement]:
    memory = {
        impl: Measurement(**_subprocess("--memory", {"group": asdict(group), "impl": impl})) for impl in group.impls
    }
    times = _subprocess("--timing", {"group": asdict(group)}) if group.rounds else {}
    return {impl: Measurement(times.get(impl, m.time_s), m.peak_extra_mib, m.saved_mib) for impl, m in memory.items()}


def _ratio(value: float | None, reference: float | None) -> str:
    if value is None or not reference:
        return "-"
    return f"{value / reference:.2f}x"


def print_group(group: Group, results: dict[str, Measurement]) -> None:
    ref = results[group.impls[0]]
    rounds = f"{group.rounds} timed rounds" if group.rounds else "time of the memory run"
    print(f"\n{group.title}  (reference: {group.impls[0]}; {rounds})")
    print(f"{'impl':<14} {'time':>10} {'x ref':>7} {'peak extra':>12} {'x ref':>7} {'saved':>10} {'x ref':>7}  target")
    for impl, m in results.items():
        ratios = {"time": m.time_s / ref.time_s, "mem": m.peak_extra_mib / max(ref.peak_extra_mib, 1e-9)}
        if m.saved_mib is not None and ref.saved_mib:
            ratios["saved"] = m.saved_mib / ref.saved_mib
        verdict = ""
        if impl.startswith("bios"):
            verdict = ", ".join(
                f"{k}<={limit}x {'met' if ratios[k] <= limit else 'MISSED'}" for k, limit in group.targets.items()
            )
        saved = f"{m.saved_mib:.1f} MiB" if m.saved_mib is not None else "-"
        print(
            f"{impl:<14} {m.time_s * 1e3:>8.1f}ms {_ratio(m.time_s, ref.time_s):>7} "
            f"{m.peak_extra_mib:>8.0f} MiB {_ratio(m.peak_extra_mib, ref.peak_extra_mib):>7} "
            f"{saved:>10} {_ratio(m.saved_mib, ref.saved_mib):>7}  {verdict}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller shapes and fewer repetitions")
    parser.add_argument("--only", default="ce,lora,norms,adamw", help="comma-separated subset of the default")
    parser.add_argument("--memory", help=argparse.SUPPRESS)  # internal: one implementation's memory run
    parser.add_argument("--timing", help=argparse.SUPPRESS)  # internal: one group's interleaved timing
    args = parser.parse_args()
    if args.memory:
        spec = json.loads(args.memory)
        print(json.dumps(asdict(measure_memory(Group(**spec["group"]), spec["impl"]))))
        return
    if args.timing:
        print(json.dumps(measure_times(Group(**json.loads(args.timing)["group"]))))
        return
    print(describe_machine())
    print("time: median fwd+bwd (adamw: one optimizer step); peak extra: RSS high-water mark above the inputs")
    for group in groups(args.quick, set(args.only.split(","))):
        print_group(group, run_group(group))


if __name__ == "__main__":
    main()
