"""PyTorch's own CPU matmul against oneDNN's on the shapes Bios multiplies frozen weights with, per dtype.

    python bench/gemm.py [--model smollm2] [--rounds 7] [--dtypes float32,bfloat16]

`bios.kernels.frozen_matmul` sends fp32 matmuls against frozen weights to oneDNN (`BIOS_GEMM=aten` keeps
PyTorch's, which is MKL's sgemm for fp32 and oneDNN already for bf16). This prints, for the model's layer shapes
with a training pass's 512 rows and a decode step's 16 and 1 (forward `x Wᵀ`, and `g W` as backward does)
and for 2048^3, each side's GFLOP/s and the ratio, rounds alternating so machine load falls on both.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bios.kernels.frozen_matmul import onednn_linear  # noqa: E402
from bios.models import load_base_model  # noqa: E402
from machine import describe_machine  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _cases(model_name: str, dtype: torch.dtype) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(label, x, weight [out, in]) with `x @ weight.T` the product; `g W` is x [rows, out] times weight.T."""
    model = load_base_model(model_name, dtype=dtype).model
    shapes = sorted({tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)})
    cases = []
    for rows in (512, 16, 1):
        for out_features, in_features in shapes:
            weight = torch.randn(out_features, in_features, dtype=dtype)
            cases.append((f"{rows} x {in_features} -> {out_features}", torch.randn(rows, in_features, dtype=dtype),
                          weight))
            if rows == 512:
                cases.append((f"g W: {rows} x {out_features} -> {in_features}",
                              torch.randn(rows, out_features, dtype=dtype), weight.T))
    square = torch.randn(2048, 2048, dtype=dtype)
    cases.append(("2048^3", torch.randn(2048, 2048, dtype=dtype), square))
    return cases


def _seconds(matmul, repeats: int) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        matmul()
    return (time.perf_counter() - started) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    print(describe_machine())
    for dtype_name in args.dtypes.split(","):
        dtype = DTYPES[dtype_name]
        print(f"\n{dtype_name}: {'shape':<30} {'PyTorch GFLOP/s':>16} {'oneDNN GFLOP/s':>15} {'oneDNN/PyTorch':>15}")
        for label, x, weight in _cases(args.model, dtype):
            flops = 2.0 * x.shape[0] * x.shape[1] * weight.shape[0]
            repeats = max(1, int(2e9 / flops))  # ~10 ms of work per timing at 200 GFLOP/s
            sides = {"aten": lambda: torch.nn.functional.linear(x, weight),
                     "onednn": lambda: onednn_linear(x, weight)}
            times: dict[str, list[float]] = {side: [] for side in sides}
            for side, matmul in sides.items():
                matmul()  # warm-up
            for _ in range(args.rounds):
                for side, matmul in sides.items():
                    times[side].append(_seconds(matmul, repeats))
            aten, onednn = (statistics.median(times[side]) for side in sides)
            print(f"{'':<{len(dtype_name) + 1}} {label:<30} {flops / aten / 1e9:16.1f} {flops / onednn / 1e9:15.1f} "
                  f"{aten / onednn:15.2f}", flush=True)
    print(f"\n(after the run) {describe_machine()}")


if __name__ == "__main__":
    main()
