"""Placement: a mixed workload on groups of workers (this checkout) against the one-pool layout (a commit
before placement, every worker holding every model), in the same run, rounds alternating.

Three base models of different sizes (the built-in tiny Llama and two random Llamas written here), eight
tenants (small and large batches), four CPU workers whose `--memory-limit` holds any one model's plan but not
all three. Each round trains every tenant `--steps` pipelined steps at once and reports tokens/s per model and
the peak RSS of each worker (VmHWM) against its budget.

    python bench/placement.py [--pool-commit f80a21a] [--rounds 2] [--steps 4]

The pool side runs from a `git worktree` of `--pool-commit`, its own `bios` package first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # two random Llamas beside the built-in tiny one; the byte-level tokenizer of the built-ins
    "medium": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64),
    "large": dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=96),
}
# (model, rows per batch) of the eight tenants: small and large batches on every model
TENANTS = [("tiny", 2), ("tiny", 2), ("tiny", 32), ("medium", 2), ("medium", 16), ("medium", 16),
           ("large", 2), ("large", 16)]
SEQ = 128


def write_models(directory: Path) -> dict[str, str]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bios.models import resolve_model_dir
    from bios.models.cache import save_model_files

    tiny = resolve_model_dir("bios/tiny-llama")
    base = {k: v for k, v in json.loads((tiny / "config.json").read_text()).items()
            if k not in ("model_type", "architectures")}
    out = {"tiny": "bios/tiny-llama"}
    for name, shape in SHAPES.items():
        target = directory / name
        target.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(0)
        save_model_files(LlamaForCausalLM(LlamaConfig(**{**base, **shape})), target)
        for f in tiny.iterdir():
            if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
                shutil.copy(f, target / f.name)
        out[name] = str(target)
    return out


def budget(models: dict[str, str]) -> int:
    """A worker budget that holds the largest model's smallest plan with room, but not the three together."""
    from bios.models.memory_plan import USABLE_FRACTION, estimate, model_shape

    def need(name: str) -> int:
        return estimate(model_shape(models[name]), lora_rank=8, batch_tokens=4096, num_adapters=3,
                        overhead_bytes=450 << 20).total

    one = max(need(name) for name in models)
    return int(one * 1.3 / USABLE_FRACTION)


def batch(rows: int, salt: int):
    from bios import types

    data = []
    for i in range(rows):
        tokens = [(salt * 31 + i * 7 + j * 13) % 250 + 1 for j in range(SEQ + 1)]
        data.append(types.Datum(types.ModelInput.from_ints(tokens[:-1]),
                                {"target_tokens": tokens[1:], "weights": [1.0] * SEQ}))
    return data


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def one_round(models: dict[str, str], limit: int, steps: int) -> dict:
    """Run inside the side's process: the workload once; tokens/s per model and each worker's peak RSS."""
    import bios
    from bios import types

    params = types.AdamParams(learning_rate=1e-4)
    with bios.LocalCluster(workers=4, worker_threads=1, worker_memory_limit=limit) as cluster, \
            bios.ServiceClient(address=cluster.address) as svc:
        deadline = time.monotonic() + 120
        while sum(w.state in ("active", "idle", "joining") for w in svc.cluster_status().workers) < 4:
            assert time.monotonic() < deadline, "workers did not come up"
            time.sleep(0.1)
        clients = [svc.create_lora_training_client(models[name], rank=8, seed=i) for i, (name, _) in enumerate(TENANTS)]
        for tc, (_, rows) in zip(clients, TENANTS):  # warm up: every model loaded, every adapter created
            tc.forward_backward(batch(rows, 0)).result(600)
            tc.optim_step(params).result(600)

        def train(index: int) -> float:
            tc, (_, rows) = clients[index], TENANTS[index]
            futures = []
            for step in range(steps):
                futures += [tc.forward_backward(batch(rows, step + 1)), tc.optim_step(params)]
            for future in futures:
                future.result(1200)
            return time.perf_counter()

        started = time.perf_counter()
        with ThreadPoolExecutor(len(clients)) as pool:
            ends = list(pool.map(train, range(len(clients))))
        wall = max(ends) - started
        tokens: dict[str, int] = {}
        for name, rows in TENANTS:
            tokens[name] = tokens.get(name, 0) + rows * SEQ * steps
        status = svc.cluster_status()
        layout = [f"{','.join(g.models)}: {g.replicas}x{g.tp}" for g in getattr(status, "groups", [])] or ["one pool"]
        return {"wall_s": wall, "tokens_per_s": {n: t / wall for n, t in tokens.items()},
                "total_tokens_per_s": sum(tokens.values()) / wall,
                "peak_rss": [peak_rss(w.pid) for w in cluster.workers], "layout": layout}


def run_side(pythonpath: Path, models: dict[str, str], limit: int, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{pythonpath}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    # This file is loaded by its path, so that `bios` comes from the side's tree (first on PYTHONPATH)
    code = ("import importlib.util, json, sys; spec = importlib.util.spec_from_file_location('bench_placement', "
            "%r); b = importlib.util.module_from_spec(spec); spec.loader.exec_module(b); import bios; "
            "r = b.one_round(json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])); "
            "r['bios'] = bios.__file__; print('RESULT ' + json.dumps(r))") % str(Path(__file__).resolve())
    done = subprocess.run([sys.executable, "-c", code, json.dumps(models), str(limit), str(steps)], env=env,
                          capture_output=True, text=True, timeout=3600, cwd=pythonpath)
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"side at {pythonpath} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads(line[len("RESULT "):])
    assert result["bios"].startswith(str(pythonpath)), f"imported {result['bios']}, not {pythonpath}'s bios"
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pool-commit", default="f80a21a", help="a commit before placement (one pool)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from machine import describe_machine

    work = Path(tempfile.mkdtemp(prefix="bench-placement-"))
    pool_tree = work / "pool"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(pool_tree), args.pool_commit],
                   check=True, capture_output=True)
    try:
        models = write_models(work / "models")
        limit = budget(models)
        print(describe_machine())
        print(f"4 workers of {limit / 2**30:.2f} GiB; tenants {TENANTS}; {SEQ} tokens a row, {args.steps} steps")
        results: dict[str, list[dict]] = {"groups": [], "pool": []}
        for round_ in range(args.rounds):
            for side, tree in (("groups", ROOT), ("pool", pool_tree)) if round_ % 2 == 0 else \
                    (("pool", pool_tree), ("groups", ROOT)):
                result = run_side(tree, models, limit, args.steps)
                results[side].append(result)
                per_model = ", ".join(f"{n} {v:.0f}" for n, v in result["tokens_per_s"].items())
                over = [f"{r / 2**30:.2f}" for r in result["peak_rss"]]
                print(f"round {round_ + 1} {side:6}: {result['total_tokens_per_s']:.0f} tokens/s ({per_model}); "
                      f"peak RSS GiB {over} of {limit / 2**30:.2f}; {'; '.join(result['layout'])}")
        best = {side: max(r["total_tokens_per_s"] for r in rs) for side, rs in results.items()}
        worst_over = {side: max(max(r["peak_rss"]) for r in rs) / limit for side, rs in results.items()}
        print(f"groups / pool total tokens/s (best rounds): {best['groups'] / best['pool']:.2f}x; "
              f"highest worker peak / budget: groups {worst_over['groups']:.2f}, pool {worst_over['pool']:.2f}")
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(pool_tree)], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
