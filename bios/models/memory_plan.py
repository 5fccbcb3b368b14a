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

MoE layers count every routed expert's weights and adapter but the activations of the token's active experts
only; tensor parallelism splits their routed experts over the group (expert parallelism), while a worker's
activations keep every active expert (routing may send them all to it). Layouts this arithmetic does not know
(GPT-2, Phi-3, MLA, shared experts) take their weights from the safetensors headers when the model directory
is at hand (`bios.models.model_shape`), and are not tensor-parallel split.
A vision-language model adds its frozen image encoder to the weights and, to the activations, the encoder's
working set over a pass whose every token is an image token (an upper bound: `bios.models.vision_shape`).

Pure arithmetic on plain data (no torch, no Transformers), so the coordinator plans from a `config.json`
(`model_shape`) while the worker keeps what needs a model (`bios.worker.memory_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Literal

from bios.exceptions import BadRequestError
from bios.models.long_rows import MLP_CHUNK_TOKENS, kv_cache_bytes, longest_row
from bios.models.model_shape import ModelShape, model_shape

__all__ = ["MemoryEstimate", "ModelShape", "Plan", "choose_plan", "estimate", "longest_row", "model_shape"]

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
# The fused head (bios.kernels.linear_cross_entropy) holds one [chunk, vocab] buffer, lent to its forward and
# to a backward recomputation (a trainable head) in turn and kept between calls; chunk = 2^26 / vocab rows, at
# most 512.
_FUSED_LOGITS_BUFFERS = 1
_FUSED_CHUNK_ELEMENTS = 1 << 26
_FUSED_MAX_CHUNK = 512
# What a worker holds before any model, when it did not measure it: CPU = Python + torch + the Transformers
# model code (RSS, measured 390 MiB with torch 2.13 and transformers 5); CUDA = the context and allocator slack.
RUNTIME_OVERHEAD = {"cpu": 400 * MiB, "cuda": 1 * GiB}
# A plan fits when its estimate is at most this share of the budget: the estimate is good to ~25%.
USABLE_FRACTION = 0.9
TENSOR_PARALLEL_SIZES = (2, 3, 4)


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
    # The longest row a worker trains under this plan, over 1, 2, ... replicas: a row longer than `batch_tokens`
    # runs alone in a checkpointed pass, or split over the replicas (`longest_row`); () where unbounded (tests).
    longest_rows: tuple[int, ...] = ()
    longest_forward_rows: tuple[int, ...] = ()  # the same for a request that trains nothing (no graph)
    kv_bytes_per_token: int = 0  # a decode's key/value cache per row and position (`kv_cache_bytes`); 0: unknown
    decode_bytes: int = 0  # what a decode holds besides its cache: base, adapters, runtime, a prefill pass

    def longest_sample(self, rows: int) -> int | None:
        """The most positions (prompt and new tokens) `rows` decode rows may hold: the budget less
        `decode_bytes`, over their key/value cache. None: unknown."""
        if not self.kv_bytes_per_token:
            return None
        room = USABLE_FRACTION * self.budget_bytes - self.decode_bytes
        return max(0, int(room // (rows * self.kv_bytes_per_token)))

    def longest_row(self, replicas: int = 1, *, forward_only: bool = False) -> int | None:
        """The longest row over `replicas` replicas of this plan (None: unbounded); `forward_only`: of a request
        that trains nothing, which builds no graph."""
        if not self.longest_rows:
            return None
        training = self.longest_rows[min(replicas, len(self.longest_rows)) - 1]
        if not (forward_only and self.longest_forward_rows):
            return training
        return max(training, self.longest_forward_rows[min(replicas, len(self.longest_forward_rows)) - 1])

    @property
    def name(self) -> str:
        parts = ["replicate" if self.tp == 1 else f"tp{self.tp}"]
        if self.dtype != "float32":
            parts.append("bf16")
        if self.activation_checkpointing:
            parts.append("checkpointing")
        return "+".join(parts)

    def describe(self, split_over: int | None = None) -> str:
        """One line for `bios status` and `get_info`; its rows over `split_over` replicas (default: all of them;
        1 for a model whose long rows do not split)."""
        layout = f"{self.replicas} replica(s) x {self.tp} tensor-parallel worker(s)"
        over = self.replicas if split_over is None else split_over
        trained, forward = self.longest_row(over), self.longest_row(over, forward_only=True)
        rows = f", rows of <= {trained} tokens" if trained is not None else ""
        if forward is not None and trained is not None and forward > trained:
            rows += f" (forward only: <= {forward} tokens)"
        return (
            f"{self.name}: {layout}, {self.dtype} base weights, activation checkpointing "
            f"{'on' if self.activation_checkpointing else 'off'}, <= {self.batch_tokens} tokens per pass{rows}"
            f"; {self.estimate.describe()} per worker of {_gib(self.budget_bytes)}"
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
    mlp_chunk: int | None = None,
    forward_only: bool = False,
) -> MemoryEstimate:
    """Peak bytes on one worker for one forward/backward pass of `batch_tokens` tokens (plus the optimizer).

    Every LoRA target is counted (attention, MLP and the output head), which is the default `LoraConfig` and
    an upper bound otherwise. `tp` > 1 splits the decoder layers' projections and their activations over `tp`
    workers; embeddings, output head and norms are replicated on each. `fused_kernels` says whether the
    worker runs `bios.kernels` (`BIOS_KERNELS`, on by default) or the stock ops, which keep more per layer and
    the whole [tokens, vocab] logits. `overhead_bytes` is the worker's measured runtime footprint (default:
    `RUNTIME_OVERHEAD` of the device type). `mlp_chunk`: a checkpointed long row's pass runs dense MLPs that
    many positions at a time (`bios.models.long_rows.MLP_CHUNK_TOKENS`). `forward_only`: a pass that builds no
    graph (a forward-only request's), which holds one layer's tensors at a time.
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
            shape, lora_rank, batch_tokens, dtype, activation_checkpointing, tp, fused_kernels, mlp_chunk, forward_only
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
    tp: int | None = None,
    max_replicas: int = 32,
) -> Plan:
    """The first plan that fits `budget_bytes` per worker, in order of preference (see the module docstring);
    only plans of tensor-parallel size `tp` if given (a group's adapters are cut that way already).

    With `max_batch_tokens`, the chosen plan's per-pass budget then doubles from `batch_tokens` while the plan
    still fits, up to that many tokens: fewer, longer passes do the same work in fewer, larger matmuls (on an
    H100, SmolLM2 steps of 8x1024 tokens run 2.1x slower in passes of 4096 tokens than in one pass, the GPU
    waiting on kernel launches).

    The plan's longest rows are sized for 1 to `max_replicas` replicas (groups grow after a plan is chosen).

    `allow_bf16=False` keeps the base in fp32 (results then match a single fp32 worker to rounding) and reaches
    for tensor parallelism instead. Raises `BadRequestError` when no plan fits.
    """
    shape = config if isinstance(config, ModelShape) else ModelShape.from_config(config)
    dtypes: tuple[Dtype, ...] = ("float32", "bfloat16") if allow_bf16 else ("float32",)
    tried: list[tuple[int, Dtype, bool, MemoryEstimate]] = []
    skipped: list[str] = []
    pinned = tp
    for tp in (pinned,) if pinned else (1, *TENSOR_PARALLEL_SIZES):
        if tp > workers:
            skipped.append(f"TP={tp} needs {tp} workers, the pool has {workers}")
            break
        if problem := shape.tensor_parallel_problem(tp):
            skipped.append(f"no TP={tp}: {problem}")
            continue
        for dtype in dtypes:
            for checkpointing in (False, True):
                sized = partial(estimate, config, lora_rank=lora_rank, dtype=dtype,
                                activation_checkpointing=checkpointing, tp=tp, num_adapters=num_adapters,
                                device_type=device_type, fused_kernels=fused_kernels, overhead_bytes=overhead_bytes)
                found = sized(batch_tokens=batch_tokens)
                tried.append((tp, dtype, checkpointing, found))
                if found.total <= USABLE_FRACTION * budget_bytes:
                    plan = Plan(tp, workers // tp, dtype, checkpointing, batch_tokens, found, budget_bytes)
                    while max_batch_tokens and plan.batch_tokens * 2 <= max_batch_tokens:
                        wider = sized(batch_tokens=plan.batch_tokens * 2)
                        if wider.total > USABLE_FRACTION * budget_bytes:
                            break
                        plan = replace(plan, batch_tokens=plan.batch_tokens * 2, estimate=wider)
                    long_pass = partial(sized, activation_checkpointing=True, mlp_chunk=MLP_CHUNK_TOKENS)
                    rows = partial(longest_row, usable_bytes=USABLE_FRACTION * budget_bytes, fits=plan.batch_tokens,
                                   context=shape.max_context_length, shape=shape, streamed=device_type == "cpu",
                                   tp=tp)
                    # a prompt's prefill, a pass at a time, keeps no more than a checkpointed training pass
                    prefill = sized(batch_tokens=plan.batch_tokens, activation_checkpointing=True)
                    # a long row splits over replicas (each of `tp` workers)
                    over = range(1, max_replicas + 1)
                    return replace(plan, longest_rows=tuple(rows(long_pass, replicas=r) for r in over),
                                   longest_forward_rows=tuple(rows(partial(long_pass, forward_only=True), replicas=r)
                                                              for r in over),
                                   kv_bytes_per_token=kv_cache_bytes(shape, 1, 1, tp), decode_bytes=prefill.total)
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


_MLP_NAMES = ("gate_proj", "up_proj", "down_proj")


def _weight_elements(shape: ModelShape, tp: int) -> int:
    """Frozen parameters one worker holds: replicated embeddings/head/norms, 1/tp of each layer's projections.

    A MoE layer holds its routed experts (3 matrices each), router and shared experts instead of a dense MLP.
    The count read from the weight files replaces the arithmetic when the planner does not know the layout.
    """
    if shape.stored_parameters is not None and tp == 1:
        return shape.stored_parameters
    h = shape.hidden_size
    embeddings = shape.vocab_size * h * (1 if shape.tied_embeddings else 2)
    attention = mlp = 0
    for name, (fan_in, fan_out, _) in shape.linears().items():
        biased = shape.mlp_bias if name in _MLP_NAMES else shape.attention_bias
        size = fan_in * fan_out + (fan_out if biased else 0)
        if name in _MLP_NAMES:
            mlp += size
        else:
            attention += size
    router = shape.num_experts * h  # replicated; the experts split over the group (expert parallelism)
    experts = shape.num_experts * 3 * h * shape.expert_intermediate_size // tp + router
    experts += 3 * h * shape.shared_intermediate_size
    norms = 2 * h + 2 * shape.head_dim  # input/post-attention norms (+ q/k norms of Qwen3: a rounding error)
    dense_layers = shape.num_layers - shape.moe_layers
    layers = dense_layers * ((attention + mlp) // tp) + shape.moe_layers * (attention // tp + experts)
    return embeddings + layers + shape.num_layers * norms + h + _vision_parameters(shape)


def _vision_parameters(shape: ModelShape) -> int:
    if shape.vision is None:
        return 0
    if shape.vision.parameters is None:
        raise ValueError(
            "cannot count this vision-language model's image encoder from its config (only Qwen2-VL and "
            "Qwen2.5-VL towers are known): plan it from its model directory, whose weight files give the count "
            "(bios.models.model_shape.model_shape)"
        )
    return shape.vision.parameters


def _lora_elements(shape: ModelShape, rank: int, tp: int) -> int:
    """LoRA parameters one worker holds: a column-split layer keeps all of A and 1/tp of B, a row-split one
    1/tp of A and all of B; the output head's adapter is whole everywhere. A MoE layer's routed experts get
    one A/B per expert per matrix, its shared experts one per matrix."""
    attention = mlp = 0
    for name, (fan_in, fan_out, split) in shape.linears().items():
        size = rank * (fan_in + fan_out // tp) if split == "column" else rank * (fan_in // tp + fan_out)
        if name in _MLP_NAMES:
            mlp += size
        else:
            attention += size
    h, width, shared = shape.hidden_size, shape.expert_intermediate_size, shape.shared_intermediate_size
    experts = shape.num_experts * rank * (3 * h + 3 * width) // tp + (3 * rank * (h + shared) if shared else 0)
    head = rank * (shape.hidden_size + shape.vocab_size)
    dense_layers = shape.num_layers - shape.moe_layers
    return dense_layers * (attention + mlp) + shape.moe_layers * (attention + experts) + head


def _saved_per_token_layer(
    shape: ModelShape, rank: int, dtype: Dtype, tp: int, fused: bool, *, moe: bool = False
) -> float:
    """Bytes autograd saves per token in one decoder layer with LoRA on every projection.

    Per block half: the residual input and the normed output (H each; the stock RMSNorm saves an fp32 copy
    of its input). Attention: rotated q, k, v, sdpa's output and its contiguous copy for o_proj (3q + 2kv;
    with a padding mask sdpa repeats k and v to q size, so 5q, counted always). MLP: gate and up, silu(gate)
    unless the fused SwiGLU recomputes it, and the product (3I fused, 4I stock). LoRA: `x Aᵀ` per projection
    (r each). The q and I terms split over `tp` workers. A MoE layer (`moe`) keeps, for each of the token's
    active experts, its gathered input and output (2H), gate/up, the gated product (3 I_expert) and two
    rank-sized LoRA products, plus a dense MLP's share for its shared experts.
    """
    act = _DTYPE_BYTES[dtype]
    h, q = shape.hidden_size, shape.q_size
    replicated = 4 * h * act if fused else 2 * h * _FP32 + 2 * h * act
    if moe:  # a worker may hold all of a token's experts (routing decides), so expert terms do not split
        active = shape.experts_per_token
        per_expert = 2 * h + 4 * shape.expert_intermediate_size + 2 * rank
        shared = 4 * shape.shared_intermediate_size + 3 * rank
        return replicated + (5 * q / tp + active * per_expert + shared) * act + 4 * rank * act
    lora = 7 * rank * act
    return replicated + 5 * q * act / tp + _mlp_per_token(shape, dtype, tp, fused) + lora


def _activation_bytes(
    shape: ModelShape, rank: int, tokens: int, dtype: Dtype, checkpointing: bool, tp: int, fused: bool,
    mlp_chunk: int | None = None, forward_only: bool = False,
) -> int:
    dense = _saved_per_token_layer(shape, rank, dtype, tp, fused) * tokens * _ACTIVATION_FRAGMENTATION
    moe = _saved_per_token_layer(shape, rank, dtype, tp, fused, moe=True) * tokens * _ACTIVATION_FRAGMENTATION
    chunked = bool(mlp_chunk and shape.chunked_mlp and tokens > mlp_chunk and (checkpointing or forward_only))
    if chunked:  # a dense layer's MLP keeps its [tokens, intermediate] tensors for one chunk only
        dense -= _mlp_per_token(shape, dtype, tp, fused) * _ACTIVATION_FRAGMENTATION * (tokens - mlp_chunk)
    vision = shape.vision.activation_bytes(tokens, _DTYPE_BYTES[dtype]) if shape.vision is not None else 0
    if forward_only:  # no graph: one layer's tensors (at most what it would save) and its input and output
        hidden = 2 * tokens * shape.hidden_size * _DTYPE_BYTES[dtype] * _ACTIVATION_FRAGMENTATION
        return int(max(dense, moe if shape.moe_layers else 0) + hidden + vision)
    # One layer's backward: gradients of its I-sized and H-sized activations while its saved ones are live.
    dense_width, experts_width = shape.intermediate_size / tp, shape.experts_per_token * shape.expert_intermediate_size
    width = max(dense_width, experts_width)
    backward = tokens * (3 * width + 3 * shape.hidden_size) * _FP32
    if not checkpointing:
        return int((shape.num_layers - shape.moe_layers) * dense + shape.moe_layers * moe + backward + vision)
    kept = shape.num_layers * tokens * shape.hidden_size * _DTYPE_BYTES[dtype] * _CHECKPOINT_FRAGMENTATION
    if chunked:  # and their gradients, in the recomputed layer's backward (a MoE layer's experts are not chunked)
        backward = (tokens * (3 * experts_width + 3 * shape.hidden_size) + mlp_chunk * 3 * dense_width) * _FP32
    return int(kept + max(dense, moe if shape.moe_layers else 0) + backward + vision)


def _mlp_per_token(shape: ModelShape, dtype: Dtype, tp: int, fused: bool) -> float:
    """The part of `_saved_per_token_layer` that is a dense MLP's: gate, up and what it keeps of their product."""
    return (3 if fused else 4) * shape.intermediate_size * _DTYPE_BYTES[dtype] / tp


def _logits_bytes(shape: ModelShape, tokens: int, dtype: Dtype, fused: bool) -> int:
    """The output head's logits at their peak; the head is replicated, so this does not shrink with `tp`."""
    act = _DTYPE_BYTES[dtype]
    if not fused:  # fp32 copies, plus the low-precision logits `.float()` reads
        return tokens * shape.vocab_size * (_STOCK_LOGITS_COPIES * _FP32 + (act if act != _FP32 else 0))
    chunk = min(tokens, _FUSED_MAX_CHUNK, max(1, _FUSED_CHUNK_ELEMENTS // shape.vocab_size))
    per_logit = act + (_FP32 if act != _FP32 else 0)  # low-precision logits get an fp32 softmax buffer
    buffers = _FUSED_LOGITS_BUFFERS * chunk * shape.vocab_size * per_logit
    return buffers + 2 * tokens * shape.hidden_size * _FP32  # + d loss / d hidden and its scaled copy
