"""Everything a CUDA machine can tell about Bios, in one command.

    python bench/gpu_check.py                       # CUDA tests, GEMM peak, training (SmolLM2, Llama-1B), sampling
    python bench/gpu_check.py --models smollm2 --rounds 2 --skip-tests
    python bench/gpu_check.py --models smollm2 --skip-training          # CUDA tests, GEMM peak, sampling
    python bench/gpu_check.py --device cpu --models tiny --batch 2 --seq 64   # a dry run of the script itself

1. `tests/test_cuda.py` under pytest: bf16 detection, the kernels and whole training steps on the GPU against
   float64 references, NCCL between two GPUs when there are two.
2. The GPU's measured bf16 GEMM peak (8192^3, median of 10): the ceiling MFU is taken against.
3. Training, per model shape (random weights, written once; nothing downloaded): Bios's pipelined SDK loop on the
   embedded cluster (the worker's defaults: bf16 frozen base, fused kernels) against an in-process Transformers +
   PEFT loop with the base in bf16 (PEFT keeps its adapter fp32) and fused torch AdamW, rounds alternating.
   Tokens/s, the ratio, and MFU from `bench/flops.py`'s count; PEFT's peak CUDA memory.
4. Sampling: 16 samples x 64 tokens of one ~50-token prompt, one `sample` request against one batched Hugging
   Face `generate(num_return_sequences=16)` on the same bf16 weights.

On a machine whose image has torch, transformers and peft but not Bios's other needs, install only those from
carried wheels and run from the checkout without installing Bios (bench/README.md, "GPU check").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import bios  # noqa: E402
from bios import types  # noqa: E402
from bios.models import load_base_model  # noqa: E402
from bios.models.builtin import byte_level_tokenizer  # noqa: E402
from bios.models.cache import save_model_files  # noqa: E402
from bios.worker.adapter import LORA_ALPHA, lora_targets  # noqa: E402
from flops import gemm_peak, training_step_flops  # noqa: E402
from machine import describe_machine  # noqa: E402
from memory_plans import MODELS  # noqa: E402
from peak_memory import PeakMemory  # noqa: E402
from sampling import one_prompt_many_samples  # noqa: E402
from training_throughput import make_batch, pipelined_steps_per_s  # noqa: E402

SHAPES = {
    **MODELS,
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, max_position_embeddings=2048),
}


def meta_model(shape: str) -> torch.nn.Module:
    """The Llama of `shape` without weights (on the meta device): enough to count its FLOPs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(**SHAPES[shape]))


def write_model(shape: str, directory: Path, device: torch.device) -> Path:
    """A random-weight Llama of `shape` in bf16 plus the byte-level tokenizer, written once into `directory`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = directory / shape
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape])).to(torch.bfloat16)
    save_model_files(model, out)
    byte_level_tokenizer().save_pretrained(out)
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PeftLoop:
    """The hand-written reference: PEFT on the bf16 base, fp32 adapter, summed cross-entropy, fused AdamW."""

    def __init__(self, model_dir: Path, data: list[types.Datum], rank: int, device: torch.device) -> None:
        import peft

        base = load_base_model(str(model_dir), device=device, dtype=torch.bfloat16)
        modules = sorted({t.module_name.rsplit(".", 1)[-1] for t in lora_targets(base.model, types.LoraConfig(rank))})
        self.model = peft.get_peft_model(base.model, peft.LoraConfig(r=rank, lora_alpha=LORA_ALPHA,
                                                                      target_modules=modules, lora_dropout=0.0))
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0,
                                           fused=device.type == "cuda")
        self.ids = torch.tensor([d.model_input.to_ints() for d in data], device=device)
        self.targets = torch.stack([d.loss_fn_inputs["target_tokens"].to_torch() for d in data]).to(device)
        self.device = device
        self.peak_mib = 0.0

    def step(self) -> None:
        logits = self.model(input_ids=self.ids, use_cache=False).logits
        F.cross_entropy(logits.float().flatten(0, 1), self.targets.flatten(), reduction="sum").backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def steps_per_s(self, steps: int) -> float:
        peak = PeakMemory(self.device)
        sync(self.device)
        started = time.perf_counter()
        for _ in range(steps):
            self.step()
        sync(self.device)
        elapsed = time.perf_counter() - started
        self.peak_mib = max(self.peak_mib, peak.extra_mib())
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the memory back for Bios's worker, which shares the GPU
        return steps / elapsed


async def training(shape: str, model_dir: Path, args: argparse.Namespace, device: torch.device, peak: float) -> dict:
    vocab = SHAPES[shape]["vocab_size"]
    data = make_batch(vocab, [args.seq] * args.batch)
    reference = PeftLoop(model_dir, data, args.rank, device)
    for _ in range(2):
        reference.step()
    rates: dict[str, list[float]] = {"peft": [], "bios": []}
    with bios.ServiceClient() as service:
        tc = await service.create_lora_training_client_async(str(model_dir), rank=args.rank, seed=0)
        await pipelined_steps_per_s(tc, data, 3, args.depth)  # warm-up: loads the model, allocates
        for round_ in range(args.rounds):
            rates["peft"].append(reference.steps_per_s(args.steps))
            rates["bios"].append(await pipelined_steps_per_s(tc, data, args.steps, args.depth))
            print(f"  round {round_ + 1}: peft {rates['peft'][-1]:.2f} steps/s, bios {rates['bios'][-1]:.2f} steps/s",
                  flush=True)
    flops = training_step_flops(meta_model(shape), [args.seq] * args.batch, args.rank).total
    medians = {name: statistics.median(values) for name, values in rates.items()}
    return {"shape": shape, "flops": flops, "peft_peak_mib": reference.peak_mib,
            **{f"{name}_steps_per_s": rate for name, rate in medians.items()},
            **{f"{name}_mfu": rate * flops / peak for name, rate in medians.items()}}


def run_cuda_tests() -> str:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    print(result.stdout[-4000:], result.stderr[-2000:], sep="", flush=True)
    return result.stdout.strip().splitlines()[-1] if result.stdout.strip() else f"pytest exited {result.returncode}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,llama-1b", help=f"shapes from {', '.join(SHAPES)}")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round and loop")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--depth", type=int, default=4, help="steps in flight in Bios's pipelined loop")
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu for a dry run of this script")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-training", action="store_true", help="only the tests, the GEMM peak and sampling")
    parser.add_argument("--model-dir", type=Path, help="where random-weight models are written (default: a temp dir)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here; --device cpu runs a dry run of this script")
    print(describe_machine(), flush=True)
    tests = "skipped" if args.skip_tests else run_cuda_tests()
    peak = gemm_peak(torch.bfloat16, device, size=8192 if device.type == "cuda" else 1024)
    print(f"bf16 GEMM peak: {peak / 1e12:.1f} TFLOP/s", flush=True)
    model_dir = args.model_dir or Path(tempfile.mkdtemp(prefix="bios-gpu-check-"))
    results = []
    for shape in [] if args.skip_training else args.models.split(","):
        print(f"training {shape}: batch {args.batch}x{args.seq}, LoRA rank {args.rank} on every linear layer and "
              f"the head, {args.rounds} rounds of {args.steps} steps", flush=True)
        results.append(asyncio.run(training(shape, write_model(shape, model_dir, device), args, device, peak)))
    sample_shape = args.models.split(",")[0]
    prompt = [(17 * i) % 256 for i in range(50)]
    sample_dir = write_model(sample_shape, model_dir, device)
    hf_rates, bios_rates = asyncio.run(one_prompt_many_samples(str(sample_dir), prompt, 16, 64, rounds=3,
                                                                device=device, dtype=torch.bfloat16))
    hf_rate, bios_rate = statistics.median(hf_rates), statistics.median(bios_rates)

    print(f"\n{describe_machine()}\nCUDA tests: {tests}\nbf16 GEMM peak {peak / 1e12:.1f} TFLOP/s")
    print(f"\n{'model':<9} {'GFLOP/step':>10} {'PEFT tok/s':>11} {'MFU':>6} {'Bios tok/s':>11} {'MFU':>6} "
          f"{'x PEFT':>7} {'PEFT peak MiB':>14}")
    tokens = args.batch * args.seq
    for r in results:
        print(f"{r['shape']:<9} {r['flops'] / 1e9:>10.0f} {r['peft_steps_per_s'] * tokens:>11.0f} "
              f"{r['peft_mfu']:>6.1%} {r['bios_steps_per_s'] * tokens:>11.0f} {r['bios_mfu']:>6.1%} "
              f"{r['bios_steps_per_s'] / r['peft_steps_per_s']:>6.2f}x {r['peft_peak_mib']:>14.0f}")
    print(f"\nsampling {sample_shape}, 16 samples x 64 tokens of a 50-token prompt: HF generate (one batched call) "
          f"{hf_rate:.0f} tok/s, Bios {bios_rate:.0f} tok/s, {bios_rate / hf_rate:.2f}x")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
