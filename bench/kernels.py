"""Benchmark bios.kernels against the ops they replace, measured in the same run.

    python bench/kernels.py [--quick] [--only ce,lora,adamw]

Every configuration runs in a fresh subprocess (so its peak memory is its own) and reports the median time
of a few fwd+bwd repetitions and its peak extra memory: RSS high-water mark above the RSS after the inputs
were built (Linux `/proc/self/clear_refs` resets the mark), or `torch.cuda.max_memory_allocated` on GPU.
LoRA rows also report the bytes autograd keeps for backward (unique storages seen by
`saved_tensors_hooks`, parameters excluded). The table gives ratios against the reference row of the same
group; absolute times on shared CPUs are noise, ratios are the result.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bios.kernels import linear_cross_entropy, lora_linear  # noqa: E402
from bios.kernels.cross_entropy import default_chunk_size  # noqa: E402

MIB = 1 << 20
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Case:
    """One configuration: `group` rows share inputs and are compared with the group's `reference` impl."""

    group: str
    op: str
    impl: str
    shape: dict[str, int]
    dtype: str = "float32"
    reps: int = 3
    warmup: int = 1
    targets: dict[str, float] = field(default_factory=dict)  # metric -> maximum ratio vs the reference


@dataclass(frozen=True)
class Measurement:
    time_s: float
    peak_extra_mib: float
    saved_mib: float | None = None


# ------------------------------------------------------------------------------------------- one config


class PeakMemory:
    """Peak memory above the current level, for the device the benchmark runs on."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            self.base = _proc_status_kib("VmRSS")

    def extra_mib(self) -> float:
        if self.device.type == "cuda":
            return (torch.cuda.max_memory_allocated() - self.base) / MIB
        return (_proc_status_kib("VmHWM") - self.base) / 1024


def _proc_status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{key} missing from /proc/self/status: peak RSS needs Linux")


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


def _ce_step(case: Case, device: torch.device):
    n, h, v = case.shape["n"], case.shape["h"], case.shape["v"]
    dtype = DTYPES[case.dtype]
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen).to(device, dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) / h**0.5).to(device, dtype)
    targets = torch.randint(0, v, (n,), generator=gen).to(device)
    chunk = default_chunk_size(v)
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=chunk) if case.impl == "torch_chunked" else None

    def logprobs():
        if case.impl.startswith("naive"):
            return torch.log_softmax((hidden @ weight.T).float(), -1).gather(1, targets[:, None]).squeeze(1)
        if case.impl == "torch_chunked":
            return -F.linear_cross_entropy(hidden, weight, targets, reduction="none", options=options)
        return linear_cross_entropy(hidden, weight, targets)

    def run(backward: bool = True):
        if case.impl.endswith("_fwd"):
            with torch.no_grad():
                logprobs()
            return
        hidden.grad = None
        out = logprobs()
        if backward:
            out.sum().backward()

    return run, [hidden, weight]


def _lora_step(case: Case, device: torch.device):
    from peft import LoraConfig
    from peft.tuners.lora import Linear as PeftLoraLinear

    t, d, r = case.shape["tokens"], case.shape["dim"], case.shape["rank"]
    dtype = DTYPES[case.dtype]
    torch.manual_seed(0)
    base = torch.nn.Linear(d, d, bias=False).to(device, dtype).requires_grad_(False)
    dropout = 0.05 if case.impl == "peft_dropout" else 0.0
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
        if case.impl.startswith("peft"):
            y = layer(x)
        else:
            y = lora_linear(x, base.weight, None, lora_a, lora_b, 2.0)
        if backward:
            y.backward(grad_y)

    return run, [base.weight, lora_a, lora_b, x]


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


def _adamw_step(case: Case, device: torch.device):
    from bios.kernels.adamw import adamw_step

    shapes = _adapter_shapes(case.shape["rank"])
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=gen).to(device) * 0.01 for s in shapes]
    grads = [torch.randn(s, generator=gen).to(device) for s in shapes]
    hyper = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.01, "grad_clip_norm": 1.0}
    if case.impl == "bios":
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
        weight_decay=hyper["weight_decay"], foreach=case.impl == "torch_foreach", fused=case.impl == "torch_fused",
    )

    def run(backward: bool = True):
        torch.nn.utils.clip_grad_norm_(params, hyper["grad_clip_norm"], foreach=True)
        optimizer.step()

    return run, []


STEPS = {"ce": _ce_step, "lora": _lora_step, "adamw": _adamw_step}


def measure(case: Case) -> Measurement:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    run, exclude = STEPS[case.op](case, device)
    saved = _saved_mib(run, exclude) if case.op == "lora" else None
    peak = PeakMemory(device)
    times = []
    for i in range(case.warmup + case.reps):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        if i >= case.warmup:
            times.append(time.perf_counter() - start)
    return Measurement(statistics.median(times), peak.extra_mib(), saved)


# ----------------------------------------------------------------------------------------------- driver


def cases(quick: bool, only: set[str]) -> list[Case]:
    ce_targets = {"time": 1.0, "mem": 0.15}
    lora_targets = {"time": 0.9, "saved": 0.7}
    out: list[Case] = []
    if "ce" in only:
        n = 1024 if quick else 4096
        for h, v, impls, reps, warmup in [
            (576, 49152, ["naive", "bios"] if quick else ["naive", "bios", "torch_chunked"], 3, 1),
            (2048, 128256, ["naive", "bios"], 1, 0),
        ]:
            group = f"linear_cross_entropy fwd+bwd N={n} H={h} V={v}"
            out += [Case(group, "ce", impl, {"n": n, "h": h, "v": v}, reps=reps, warmup=warmup,
                         targets=ce_targets) for impl in impls]
        if not quick:
            shape = {"n": n, "h": 576, "v": 49152}
            group = f"linear_cross_entropy fwd+bwd bf16 N={n} H=576 V=49152"
            out += [Case(group, "ce", impl, shape, dtype="bfloat16", targets=ce_targets) for impl in ["naive", "bios"]]
            group = f"linear_cross_entropy no_grad N={n} H=576 V=49152"
            out += [Case(group, "ce", impl, shape, targets={"time": 1.0}) for impl in ["naive_fwd", "bios_fwd"]]
    if "lora" in only:
        for dim in [576] if quick else [576, 2048]:
            group = f"lora_linear fwd+bwd T=4096 in=out={dim} r=16"
            shape = {"tokens": 4096, "dim": dim, "rank": 16}
            impls = ["peft", "bios"] if quick else ["peft", "bios", "peft_dropout"]
            out += [Case(group, "lora", impl, shape, reps=5, targets=lora_targets) for impl in impls]
    if "adamw" in only:
        group = "adamw+clip step, rank-16 SmolLM2-135M adapter (4.9M params)"
        impls = ["torch_foreach", "bios"] if quick else ["torch_foreach", "bios", "torch_fused"]
        out += [Case(group, "adamw", impl, {"rank": 16}, reps=10 if quick else 30, warmup=3,
                     targets={"time": 1.0}) for impl in impls]
    return out


def run_in_subprocess(case: Case) -> Measurement:
    result = subprocess.run(
        [sys.executable, __file__, "--case", json.dumps(asdict(case))], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"benchmark case {case.group} / {case.impl} failed:\n{result.stderr[-3000:]}")
    return Measurement(**json.loads(result.stdout.strip().splitlines()[-1]))


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
        cpu = names[0] if names else cpu
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return (
        f"machine: {cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"device {device}, python {platform.python_version()}"
    )


def _ratio(value: float | None, reference: float | None) -> str:
    if value is None or not reference:
        return "-"
    return f"{value / reference:.2f}x"


def print_table(results: list[tuple[Case, Measurement]]) -> None:
    header = f"{'impl':<14} {'time':>10} {'x ref':>7} {'peak extra':>12} {'x ref':>7} {'saved':>10} {'x ref':>7}  target"
    references: dict[str, Measurement] = {}
    current = None
    for case, m in results:
        if case.group != current:
            current = case.group
            references[current] = m
            print(f"\n{current}  (reference: {case.impl})\n{header}")
        ref = references[current]
        ratios = {"time": m.time_s / ref.time_s, "mem": m.peak_extra_mib / max(ref.peak_extra_mib, 1e-9)}
        if m.saved_mib is not None and ref.saved_mib:
            ratios["saved"] = m.saved_mib / ref.saved_mib
        verdict = ""
        if case.impl.startswith("bios") and case.targets:
            checks = [f"{k}<={limit}: {'met' if ratios.get(k, 0) <= limit else 'MISSED'}" for k, limit in case.targets.items()]
            verdict = ", ".join(checks)
        saved = f"{m.saved_mib:.1f} MiB" if m.saved_mib is not None else "-"
        print(
            f"{case.impl:<14} {m.time_s * 1e3:>8.1f}ms {_ratio(m.time_s, ref.time_s):>7} "
            f"{m.peak_extra_mib:>8.0f} MiB {_ratio(m.peak_extra_mib, ref.peak_extra_mib):>7} "
            f"{saved:>10} {_ratio(m.saved_mib, ref.saved_mib):>7}  {verdict}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller shapes and fewer repetitions")
    parser.add_argument("--only", default="ce,lora,adamw", help="comma-separated subset of ce, lora, adamw")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one configuration, print JSON
    args = parser.parse_args()
    if args.case:
        spec = json.loads(args.case)
        print(json.dumps(asdict(measure(Case(**spec)))))
        return
    print(machine())
    print("times are medians of fwd+bwd (or one optimizer step); peak extra = RSS high-water mark above the inputs")
    results = []
    for case in cases(args.quick, set(args.only.split(","))):
        results.append((case, run_in_subprocess(case)))
        print(f"  measured {case.group} / {case.impl}: {results[-1][1]}", file=sys.stderr, flush=True)
    print_table(results)


if __name__ == "__main__":
    main()
