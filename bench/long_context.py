"""Long rows: the longest row a worker trains under its `--memory-limit`, tokens/s and peak memory at 4k, 16k and
32k-token rows on 1, 2 and 4 workers, against an in-process PyTorch + PEFT loop with Hugging Face's gradient
checkpointing on the same row, in the same run, rounds alternating.

    python bench/long_context.py [--lengths 4096,16384,32768] [--workers 1,2,4] [--limit-gib 1.4] [--rounds 2]

The model is a random Llama (4 layers of width 256, a 64k context) written here with the built-ins' byte-level
tokenizer. A row longer than the planner's longest row is refused at acceptance (the message is printed); a row
longer than one worker's pass is split by sequence over the group's workers (`bios.worker.context_parallel`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import bios
from bios import types
from bios.exceptions import BadRequestError
from bios.models import resolve_model_dir
from bios.models.cache import save_model_files
from bios.worker.adapter import LORA_ALPHA

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe_machine  # noqa: E402

SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=65536)
RANK = 8
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def write_model(directory: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = resolve_model_dir("bios/tiny-llama")
    fields = {k: v for k, v in json.loads((tiny / "config.json").read_text()).items()
              if k not in ("model_type", "architectures")}
    torch.manual_seed(0)
    save_model_files(LlamaForCausalLM(LlamaConfig(**{**fields, **SHAPE})), directory)
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, directory / f.name)
    return directory


def row(length: int, salt: int = 0) -> types.Datum:
    tokens = torch.randint(1, 250, (length + 1,), generator=torch.Generator().manual_seed(salt)).tolist()
    return types.Datum(types.ModelInput.from_ints(tokens[:-1]),
                       {"target_tokens": tokens[1:], "weights": [1.0] * length})


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def bios_side(model: Path, workers: int, limit: int, lengths: list[int | str]) -> dict:
    """One cluster of `workers`: its longest row, then each length's tokens/s (one forward_backward and
    optim_step, after a warm-up at the first length) and every worker's peak RSS; refusals with their message.
    The length "longest" is the cluster's own longest row (`get_info().longest_row`), trained."""
    params = types.AdamParams(learning_rate=1e-4)
    out: dict = {"lengths": {}}
    with bios.LocalCluster(workers=workers, worker_threads=max(1, torch.get_num_threads() // workers),
                           worker_memory_limit=limit) as cluster, bios.ServiceClient(address=cluster.address) as svc:
        deadline = time.monotonic() + 120
        while sum(w.state in ("active", "idle") for w in svc.cluster_status().workers) < workers:
            assert time.monotonic() < deadline, "workers did not come up"
            time.sleep(0.2)
        tc = svc.create_lora_training_client(str(model), rank=RANK, seed=0)
        info = tc.get_info()
        out["longest_row"], out["plan"] = info.longest_row, info.memory_plan
        lengths = [info.longest_row if length == "longest" else length for length in lengths]
        warm = min(lengths[0], info.longest_row or lengths[0])
        tc.forward_backward([row(warm)]).result(3600)
        tc.optim_step(params).result(600)
        for length in lengths:
            started = time.perf_counter()
            try:
                tc.forward_backward([row(length, salt=length)]).result(3600)
            except BadRequestError as exc:
                out["lengths"][length] = {"refused": exc.message}
                continue
            tc.optim_step(params).result(600)
            out["lengths"][length] = {"tokens_per_s": length / (time.perf_counter() - started),
                                      "peak_gib": [peak_rss(w.pid) / 2**30 for w in cluster.workers]}
    return out


def peft_tokens_per_s(model: Path, length: int) -> float:
    """One step of an in-process Transformers + PEFT loop on a row of `length`, gradient checkpointing on (what a
    long row takes there): tokens/s."""
    import peft
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net = peft.get_peft_model(base, peft.LoraConfig(r=RANK, lora_alpha=LORA_ALPHA, target_modules=MODULES,
                                                    lora_dropout=0.0))
    net.train()
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-4)
    datum = row(length, salt=length)
    ids = torch.tensor([datum.model_input.to_ints()])
    targets = datum.loss_fn_inputs["target_tokens"].to_torch()[None]
    started = time.perf_counter()
    logits = net(input_ids=ids).logits.float()
    (-torch.log_softmax(logits, -1).gather(-1, targets[..., None]).sum()).backward()
    optimizer.step()
    return length / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="4096,16384,32768",
                        help='row lengths in tokens; "longest": each cluster\'s own longest row')
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--limit-gib", type=float, default=1.4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    lengths: list[int | str] = [x if x == "longest" else int(x) for x in args.lengths.split(",")]
    limit = int(args.limit_gib * 2**30)
    work = Path(tempfile.mkdtemp(prefix="bench-long-"))
    try:
        model = write_model(work / "long")
        print(describe_machine())
        print(f"random Llama {SHAPE}, LoRA rank {RANK}, workers of {args.limit_gib:.2f} GiB, fp32")
        bios_rates: dict[int, list[float]] = {n: [] for n in lengths if n != "longest"}
        peft_rates: dict[int, list[float]] = {n: [] for n in lengths if n != "longest"}
        longest: dict[int, int] = {}
        for workers in [int(x) for x in args.workers.split(",")]:
            rounds = args.rounds if workers == 1 else 1  # the reference is compared with one worker
            for round_ in range(rounds):
                result = bios_side(model, workers, limit, lengths)
                longest[workers] = result["longest_row"]
                if workers == 1:
                    for length in bios_rates:  # the reference, after Bios (rounds alternate: Bios, PEFT, Bios...)
                        if "tokens_per_s" in result["lengths"][length]:
                            peft_rates[length].append(peft_tokens_per_s(model, length))
                            bios_rates[length].append(result["lengths"][length]["tokens_per_s"])
                print(f"{workers} worker(s), round {round_ + 1}: longest row {result['longest_row']} tokens "
                      f"({result['plan']})")
                for length, got in result["lengths"].items():
                    if "refused" in got:
                        print(f"  {length:>6} tokens: refused at acceptance: {got['refused'][:160]}...")
                    else:
                        peaks = ", ".join(f"{p:.2f}" for p in got["peak_gib"])
                        print(f"  {length:>6} tokens: {got['tokens_per_s']:8.0f} tokens/s; peak RSS GiB [{peaks}] "
                              f"of {args.limit_gib:.2f}")
        if 1 in longest:
            print("longest trainable row: " + ", ".join(f"{workers} worker(s) {rows} tokens ({rows / longest[1]:.2f}x "
                                                        "one)" for workers, rows in longest.items()))
        for length in bios_rates:
            if bios_rates[length]:
                ours, theirs = statistics.median(bios_rates[length]), statistics.median(peft_rates[length])
                print(f"{length:>6} tokens on 1 worker: bios {ours:.0f} tokens/s, PEFT + checkpointing "
                      f"{theirs:.0f} tokens/s: {ours / theirs:.2f}x")
        print(f"(after the run) {describe_machine()}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
