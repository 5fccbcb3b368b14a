"""How much memory one worker needs to train LoRA adapters on a base model, and which plan makes it fit.

`estimate` adds up, per worker: the frozen base weights it holds, each adapter's five flat fp32 buffers
(params, grad, pending grad, two AdamW moments), the activations autograd keeps for one forward/backward pass
of `batch_tokens` tokens, the output-head logits of that pass, and the runtime's own footprint. The
per-layer activation counts are those autograd saves in a Llama decoder layer with LoRA on every linear
(checked with `saved_tensors_hooks`); the constants below that are not counts were fitted against the peak
RSS of fresh CPU worker processes (tests/test_memory_plan.py, bench/memory_plans.py) and cover what is not a
saved tensor: glibc heap fragmentation, backward temporaries. The runtime itself (Python, torch, the
Transformers model code) is measured by each worker when it starts (`runtime_footprint` in the worker) and
reported with its budget; `RUNTIME_OVERHEAD` is only the fallback. On CUDA the caching allocator's slack
differs; the same factors apply until they are measured there.

`choose_plan` walks the plans from cheapest to run to most intrusive and returns the first that fits:
replicate (data parallel) in fp32, then with activation checkpointing, then bf16 frozen weights, then tensor
parallel over 2, 3 or 4 workers (each again fp32, checkpointed, bf16; 3 serves models whose head counts are
multiples of 3, like SmolLM2's 9 query and 3 key/value heads). A model that fits nowhere gets a
`BadRequestError` that says what it needs and what the workers have.

Pure arithmetic on plain data (no torch, no Transformers), so the coordinator plans from a `config.json`
(`model_shape`) while the worker keeps what needs a model (`bios.worker.memory_plan`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from bios.exceptions import BadRequestError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

Dtype = Literal["float32", "bfloat16"]
DeviceType = Literal["cpu", "cuda"]

GiB = 1 << 30
MiB = 1 << 20

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
_FP32 = 4
# Peak RSS grows ~1.25x faster with saved activations than their bytes do (glibc keeps the holes freed
# forward temporaries leave and the backward's gradients come in other sizes): fitted over 6 to 30 layers.
_ACTIVATION_FRAGMENTATION = 1.25
# Under activation checkpointing each layer's kept input pins ~4x its own size of heap (the holes its
# discarded activations leave around it): fitted on 6 and 30 checkpointed layers.
_CHECKPOINT_FRAGMENTATION = 4
# The stock (BIOS_KERNELS=0) output head materialises [tokens, vocab] fp32 logits; at its backward peak the
# logits, logsumexp's exp temporary, the gather's scattered gradient and their sum coexist (measured 3.4-4.1).
_STOCK_LOGITS_COPIES = 4
# The fused head (bios.kernels.linear_cross_entropy) holds one [chunk, vocab] buffer in forward and one in
# the backward recomputation (a trainable head LoRA), chunk = 2^26 / vocab rows, at most 512.
_FUSED_LOGITS_BUFFERS = 2
_FUSED_CHUNK_ELEMENTS = 1 << 26
_FUSED_MAX_CHUNK = 512
# What a worker holds before any model, when it did not measure it: CPU = Python + torch + the Transformers
# model code (RSS, measured 390 MiB with torch 2.13 and transformers 5); CUDA = the context and allocator slack.
RUNTIME_OVERHEAD = {"cpu": 400 * MiB, "cuda": 1 * GiB}
# A plan fits when its estimate is at most this share of the budget: the estimate is good to ~25%.
USABLE_FRACTION = 0.9
TENSOR_PARALLEL_SIZES = (2, 3, 4)


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama-family decoder (Llama, Mistral, Qwen2/3, SmolLM) that memory depends on."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    max_context_length: int | None = None  # max_position_embeddings, so requests can be checked before a load

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> ModelShape:
        """From the fields of a `config.json` (a multimodal config's `text_config` is the decoder's)."""
        text = {**config, **config.get("text_config", {})}
        return cls.from_config(_Fields(text, tie=config.get("tie_word_embeddings", False)))

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> ModelShape:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        missing = [
            key
            for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
            if getattr(text, key, None) is None
        ]
        if missing:
            raise BadRequestError(
                f"cannot plan memory for a {getattr(text, 'model_type', 'unknown')} model: its config has no "
                f"{', '.join(missing)}; memory planning knows Llama-family decoders (Llama, Mistral, Qwen, SmolLM)",
                field="base_model",
            )
        heads = int(text.num_attention_heads)
        return cls(
            vocab_size=int(text.vocab_size),
            hidden_size=int(text.hidden_size),
            intermediate_size=int(text.intermediate_size),
            num_layers=int(text.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(text, "attention_bias", False)),
            mlp_bias=bool(getattr(text, "mlp_bias", False)),
            max_context_length=getattr(text, "max_position_embeddings", None),
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linears(self) -> dict[str, tuple[int, int, str]]:
        """Per decoder layer: projection name -> (in, out, how tensor parallelism splits it)."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_size, self.kv_size
        return {
            "q_proj": (h, q, "column"),
            "k_proj": (h, kv, "column"),
            "v_proj": (h, kv, "column"),
            "o_proj": (q, h, "row"),
            "gate_proj": (h, i, "column"),
            "up_proj": (h, i, "column"),
            "down_proj": (i, h, "row"),
        }

    def tensor_parallel_problem(self, tp: int) -> str | None:
        """Why this model cannot be split over `tp` workers, or None when it can."""
        for what, count in (
            ("attention heads", self.num_heads),
            ("key/value heads", self.num_kv_heads),
            ("MLP intermediate size", self.intermediate_size),
        ):
            if count % tp:
                return f"its {count} {what} do not split evenly over {tp} workers"
        return None


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one worker needs, by what needs them."""

    weights: int  # frozen base weights this worker holds (its shard under tensor parallelism)
    adapters: int  # LoRA params + grad + pending grad + AdamW exp_avg + exp_avg_sq, fp32, every adapter
    activations: int  # saved for backward over one pass, plus the recomputed layer when checkpointing
    logits: int  # the output head's [tokens, vocab] logits and their gradient
    overhead: int  # the runtime itself

    @property
    def total(self) -> int:
        return self.weights + self.adapters + self.activations + self.logits + self.overhead

    def describe(self) -> str:
        names = ("weights", "adapters", "activations", "logits", "overhead")
        parts = ", ".join(f"{name} {_gib(getattr(self, name))}" for name in names)
        return f"~{_gib(self.total)} ({parts})"


@dataclass(frozen=True)
class Plan:
    """How a base model runs on a pool: `tp` workers per replica, weight dtype, activation checkpointing.

    `batch_tokens` is the per-pass token budget the plan was sized for: the engine must split larger batches
    into passes of at most this many (padded) tokens (its `max_tokens_per_pass`).
    """

    tp: int
    replicas: int
    dtype: Dtype
    activation_checkpointing: bool
    batch_tokens: int
    estimate: MemoryEstimate
    budget_bytes: int

    @property
    def name(self) -> str:
        parts = ["replicate" if self.tp == 1 else f"tp{self.tp}"]
        if self.dtype != "float32":
            parts.append("bf16")
        if self.activation_checkpointing:
            parts.append("checkpointing")
        return "+".join(parts)

    def describe(self) -> str:
        layout = f"{self.replicas} replica(s) x {self.tp} tensor-parallel worker(s)"
        return (
            f"{self.name}: {layout}, {self.dtype} base weights, activation checkpointing "
            f"{'on' if self.activation_checkpointing else 'off'}, <= {self.batch_tokens} tokens per pass; "
            f"{self.estimate.describe()} per worker of {_gib(self.budget_bytes)}"
        )


def estimate(
    config: PretrainedConfig | ModelShape,
    *,
    lora_rank: int,
    batch_tokens: int,
    dtype: Dtype = "float32",
    activation_checkpointing: bool = False,
    tp: int = 1,
    num_adapters: int = 1,
    device_type: DeviceType = "cpu",
    fused_kernels: bool = True,
    overhead_bytes: int | None = None,
) -> MemoryEstimate:
    """Peak bytes on one worker for one forward/backward pass of `batch_tokens` tokens (plus the optimizer).

    Every LoRA target is counted (attention, MLP and the output head), which is the default `LoraConfig` and
    an upper bound otherwise. `tp` > 1 splits the decoder layers' projections and their activations over `tp`
    workers; embeddings, output head and norms are replicated on each. `fused_kernels` says whether the
    worker runs `bios.kernels` (`BIOS_KERNELS`, on by default) or the stock ops, which keep more per layer and
    the whole [tokens, vocab] logits. `overhead_bytes` is the worker's measured runtime footprint (default:
    `RUNTIME_OVERHEAD` of the device type).
    """
    shape = config if isinstance(config, ModelShape) else ModelShape.from_config(config)
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPE_BYTES)}, got {dtype!r}")
    if tp > 1 and (problem := shape.tensor_parallel_problem(tp)):
        raise ValueError(f"cannot estimate tensor parallelism over {tp} workers: {problem}")
    weight_bytes = _DTYPE_BYTES[dtype]
    return MemoryEstimate(
        weights=_weight_elements(shape, tp) * weight_bytes,
        adapters=num_adapters * _lora_elements(shape, lora_rank, tp) * 5 * _FP32,
        activations=_activation_bytes(
            shape, lora_rank, batch_tokens, dtype, activation_checkpointing, tp, fused_kernels
        ),
        logits=_logits_bytes(shape, batch_tokens, dtype, fused_kernels),
        overhead=RUNTIME_OVERHEAD[device_type] if overhead_bytes is None else overhead_bytes,
    )


def choose_plan(
    config: PretrainedConfig | ModelShape,
    budget_bytes: int,
    *,
    lora_rank: int,
    batch_tokens: int,
    workers: int,
    allow_bf16: bool = True,
    num_adapters: int = 1,
    device_type: DeviceType = "cpu",
    fused_kernels: bool = True,
    model_name: str | None = None,
    overhead_bytes: int | None = None,
    max_batch_tokens: int | None = None,
) -> Plan:
    """The first plan that fits `budget_bytes` per worker, in order of preference (see the module docstring).

    With `max_batch_tokens`, the chosen plan's per-pass budget then doubles from `batch_tokens` while the plan
    still fits, up to that many tokens: fewer, longer passes do the same work in fewer, larger matmuls (on an
    H100, SmolLM2 steps of 8x1024 tokens run 2.1x slower in passes of 4096 tokens than in one pass, the GPU
    waiting on kernel launches).

    `allow_bf16=False` keeps the base in fp32 (results then match a single fp32 worker to rounding) and reaches
    for tensor parallelism instead. Raises `BadRequestError` when no plan fits.
    """
    shape = config if isinstance(config, ModelShape) else ModelShape.from_config(config)
    dtypes: tuple[Dtype, ...] = ("float32", "bfloat16") if allow_bf16 else ("float32",)
    tried: list[tuple[int, Dtype, bool, MemoryEstimate]] = []
    skipped: list[str] = []
    for tp in (1, *TENSOR_PARALLEL_SIZES):
        if tp > workers:
            skipped.append(f"TP={tp} needs {tp} workers, the pool has {workers}")
            break
        if problem := shape.tensor_parallel_problem(tp):
            skipped.append(f"no TP={tp}: {problem}")
            continue
        for dtype in dtypes:
            for checkpointing in (False, True):
                found = estimate(
                    config,
                    lora_rank=lora_rank,
                    batch_tokens=batch_tokens,
                    dtype=dtype,
                    activation_checkpointing=checkpointing,
                    tp=tp,
                    num_adapters=num_adapters,
                    device_type=device_type,
                    fused_kernels=fused_kernels,
                    overhead_bytes=overhead_bytes,
                )
                tried.append((tp, dtype, checkpointing, found))
                if found.total <= USABLE_FRACTION * budget_bytes:
                    plan = Plan(tp, workers // tp, dtype, checkpointing, batch_tokens, found, budget_bytes)
                    while max_batch_tokens and plan.batch_tokens * 2 <= max_batch_tokens:
                        wider = estimate(config, lora_rank=lora_rank, batch_tokens=plan.batch_tokens * 2, dtype=dtype,
                                         activation_checkpointing=checkpointing, tp=tp, num_adapters=num_adapters,
                                         device_type=device_type, fused_kernels=fused_kernels,
                                         overhead_bytes=overhead_bytes)
                        if wider.total > USABLE_FRACTION * budget_bytes:
                            break
                        plan = replace(plan, batch_tokens=plan.batch_tokens * 2, estimate=wider)
                    return plan
    tp, dtype, checkpointing, smallest = min(tried, key=lambda entry: entry[3].total)
    techniques = [f"TP={tp}"] if tp > 1 else []
    techniques += ["bf16 weights"] if dtype == "bfloat16" else []
    techniques += ["activation checkpointing"] if checkpointing else []
    best = " and ".join([", ".join(techniques[:-1]), techniques[-1]] if len(techniques) > 1 else techniques)
    why_no_more = f" ({'; '.join(skipped)})" if skipped else ""
    name = model_name or getattr(config, "name_or_path", "") or "of this config"
    raise BadRequestError(
        f"model {name} needs {smallest.describe()} per worker even with {best or 'its smallest plan'}"
        f"{why_no_more}; workers have {_gib(budget_bytes)} (plans use at most {USABLE_FRACTION:.0%} of it) for "
        f"LoRA rank {lora_rank} and {batch_tokens} tokens per pass: add workers or memory, or use a smaller "
        "model, rank or batch",
        field="base_model",
    )


def _gib(size: int) -> str:
    return f"{size / GiB:.2f} GiB"


def _weight_elements(shape: ModelShape, tp: int) -> int:
    """Frozen parameters one worker holds: replicated embeddings/head/norms, 1/tp of each layer's projections."""
    h = shape.hidden_size
    embeddings = shape.vocab_size * h * (1 if shape.tied_embeddings else 2)
    per_layer = 0
    for name, (fan_in, fan_out, _) in shape.linears().items():
        biased = shape.mlp_bias if name in ("gate_proj", "up_proj", "down_proj") else shape.attention_bias
        per_layer += fan_in * fan_out + (fan_out if biased else 0)
    norms = 2 * h + 2 * shape.head_dim  # input/post-attention norms (+ q/k norms of Qwen3: a rounding error)
    return embeddings + shape.num_layers * (per_layer // tp + norms) + h


def _lora_elements(shape: ModelShape, rank: int, tp: int) -> int:
    """LoRA parameters one worker holds: a column-split layer keeps all of A and 1/tp of B, a row-split one
    1/tp of A and all of B; the output head's adapter is whole everywhere."""
    per_layer = 0
    for fan_in, fan_out, split in shape.linears().values():
        if split == "column":
            per_layer += rank * (fan_in + fan_out // tp)
        else:
            per_layer += rank * (fan_in // tp + fan_out)
    head = rank * (shape.hidden_size + shape.vocab_size)
    return shape.num_layers * per_layer + head


def _saved_per_token_layer(shape: ModelShape, rank: int, dtype: Dtype, tp: int, fused: bool) -> float:
    """Bytes autograd saves per token in one decoder layer with LoRA on every projection.

    Per block half: the residual input and the normed output (H each; the stock RMSNorm saves an fp32 copy
    of its input). Attention: rotated q, k, v, sdpa's output and its contiguous copy for o_proj (3q + 2kv;
    with a padding mask sdpa repeats k and v to q size, so 5q, counted always). MLP: gate and up, silu(gate)
    unless the fused SwiGLU recomputes it, and the product (3I fused, 4I stock). LoRA: `x Aᵀ` per projection
    (r each). The q and I terms split over `tp` workers.
    """
    act = _DTYPE_BYTES[dtype]
    h, q, i = shape.hidden_size, shape.q_size, shape.intermediate_size
    replicated = 4 * h * act if fused else 2 * h * _FP32 + 2 * h * act
    split = (5 * q + (3 if fused else 4) * i) * act
    lora = 7 * rank * act
    return replicated + split / tp + lora


def _activation_bytes(
    shape: ModelShape, rank: int, tokens: int, dtype: Dtype, checkpointing: bool, tp: int, fused: bool
) -> int:
    per_layer = _saved_per_token_layer(shape, rank, dtype, tp, fused) * tokens * _ACTIVATION_FRAGMENTATION
    # One layer's backward: gradients of its I-sized and H-sized activations while its saved ones are live.
    backward = tokens * (3 * shape.intermediate_size / tp + 3 * shape.hidden_size) * _FP32
    if checkpointing:
        kept = shape.num_layers * tokens * shape.hidden_size * _DTYPE_BYTES[dtype] * _CHECKPOINT_FRAGMENTATION
        return int(kept + per_layer + backward)
    return int(shape.num_layers * per_layer + backward)


def _logits_bytes(shape: ModelShape, tokens: int, dtype: Dtype, fused: bool) -> int:
    """The output head's logits at their peak; the head is replicated, so this does not shrink with `tp`."""
    act = _DTYPE_BYTES[dtype]
    if not fused:  # fp32 copies, plus the low-precision logits `.float()` reads
        return tokens * shape.vocab_size * (_STOCK_LOGITS_COPIES * _FP32 + (act if act != _FP32 else 0))
    chunk = min(tokens, _FUSED_MAX_CHUNK, max(1, _FUSED_CHUNK_ELEMENTS // shape.vocab_size))
    per_logit = act + (_FP32 if act != _FP32 else 0)  # low-precision logits get an fp32 softmax buffer
    buffers = _FUSED_LOGITS_BUFFERS * chunk * shape.vocab_size * per_logit
    return buffers + 2 * tokens * shape.hidden_size * _FP32  # + d loss / d hidden and its scaled copy


class _Fields:
    """A `config.json` dict read through attributes, as `ModelShape.from_config` reads a Transformers config."""

    def __init__(self, fields: Mapping[str, Any], *, tie: bool) -> None:
        self._fields = dict(fields)
        self.tie_word_embeddings = tie

    def __getattr__(self, name: str) -> Any:
        try:
            return self._fields[name]
        except KeyError:
            raise AttributeError(name) from None


def model_shape(name: str) -> ModelShape | None:
    """The shape of base model `name` from its `config.json`, without loading anything or writing a model.

    Built-ins come from their catalog entry; other names from the directory they resolve to on this host.
    None when this host does not have the model (a pulled model not pulled yet, a directory only workers see).
    """
    from bios.models.catalog import BUILTIN_MODELS
    from bios.models.registry import UnknownModelError, _resolve, canonical_name

    name = canonical_name(name)
    if name in BUILTIN_MODELS:
        spec = BUILTIN_MODELS[name]
        return ModelShape.from_dict({"model_type": spec.model_type, **spec.config})
    try:
        directory = _resolve(name, create=False)
    except UnknownModelError:
        return None
    config_file = directory / "config.json"
    if not config_file.is_file():
        return None
    return ModelShape.from_dict(json.loads(config_file.read_text()))
