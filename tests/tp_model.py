"""The models of the tensor- and expert-parallel cluster tests and the worker budget that makes only TP=2 fit.

A random Llama of 12 layers of width 384 (tensor parallelism halves most of its activations), a random
Qwen3-MoE whose 16 experts per layer hold most of its weights (expert parallelism halves them), and a narrow
Llama with a 16k context for long rows, each with the built-ins' byte-level tokenizer, written to a local
directory: config.json is all the coordinator reads to plan.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from bios.models import resolve_model_dir
from bios.models.cache import save_model_files
from bios.models.memory_plan import MiB, USABLE_FRACTION, ModelShape, estimate

RANK = 8
SHAPE = dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=4,
             num_key_value_heads=2, head_dim=96)
# Long rows: a narrow Llama whose context reaches 16k tokens, where an 8k row's pass takes seconds on one thread.
LONG_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=16384)
# Three models that each fit a worker alone but not two together (tests/test_placement_cluster.py).
MID_SHAPE = dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=96)
MOE_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=1024)


def write_tp_model(directory: Path) -> Path:
    return _write(LlamaConfig, LlamaForCausalLM, SHAPE, directory)


def write_moe_model(directory: Path) -> Path:
    return _write(Qwen3MoeConfig, Qwen3MoeForCausalLM, MOE_SHAPE, directory)


def write_mid_model(directory: Path) -> Path:
    return _write(LlamaConfig, LlamaForCausalLM, MID_SHAPE, directory)


def write_long_model(directory: Path) -> Path:
    return _write(LlamaConfig, LlamaForCausalLM, LONG_SHAPE, directory)


def _write(config_class, model_class, shape: dict, directory: Path) -> Path:
    tiny = resolve_model_dir("bios/tiny-llama")
    fields = {key: value for key, value in json.loads((tiny / "config.json").read_text()).items()
              if key not in ("model_type", "architectures")}
    config = config_class(**{**fields, **shape})
    torch.manual_seed(0)
    save_model_files(model_class(config), directory)
    for name in tiny.iterdir():
        if name.name.startswith("tokenizer") or name.name == "special_tokens_map.json":
            shutil.copy(name, directory / name.name)
    return directory


@functools.cache
def worker_runtime_bytes() -> int:
    """The runtime footprint a CPU worker reports when it registers (`runtime_footprint`, which the coordinator's
    plans count as overhead), measured the same way in a fresh process that imports what a worker imports: it
    differs by machine and by library versions (0.35 GiB to over 0.4 here), and a budget set between two plans'
    estimates must count the overhead the workers will report, not a fallback."""
    code = ("import torch, bios.cli.worker; from bios.worker.memory_plan import runtime_footprint; "
            "print(runtime_footprint(torch.device('cpu')))")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              timeout=300).stdout.split()[-1])


def tp2_only_memory_limit(model_dir: Path) -> int:
    """A worker budget between the TP=2 plan's estimate and the smallest single-worker plan's (LoRA rank `RANK`),
    with the runtime footprint this machine's workers will report."""
    shape = ModelShape.from_dict(json.loads((model_dir / "config.json").read_text()))
    options = dict(lora_rank=RANK, batch_tokens=4096, activation_checkpointing=True,
                   overhead_bytes=worker_runtime_bytes())
    one, two = (estimate(shape, tp=tp, **options).total for tp in (1, 2))
    assert two < one - 100 * MiB, "the test model must shrink clearly under TP=2"
    return int((one + two) / 2 / USABLE_FRACTION)


def one_model_only_memory_limit(model_dir: Path) -> int:
    """A worker budget that holds one such model (weights, adapters, a pass and the runtime this machine's workers
    report) but not two: half-way between the two sums placement weighs (`bios.coordinator.placement.fits`)."""
    shape = ModelShape.from_dict(json.loads((model_dir / "config.json").read_text()))
    one = estimate(shape, lora_rank=RANK, batch_tokens=4096, activation_checkpointing=True,
                   overhead_bytes=worker_runtime_bytes())
    return int((one.total + (one.weights + one.adapters) / 2) / USABLE_FRACTION)
