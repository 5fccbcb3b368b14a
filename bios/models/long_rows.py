"""How long a row or a sample may be on a worker: the memory arithmetic of rows longer than a pass (run alone and
checkpointed, or split by sequence over a group's replicas: `bios.worker.context_parallel`) and of a decode's
key/value cache. `bios.models.memory_plan.choose_plan` sizes each plan's limits with these; plain arithmetic."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from bios.models.model_shape import ModelShape

FP32 = 4
# A long row's pass runs each dense MLP on this many positions at a time, each chunk recomputed in backward
# (`bios.worker.memory_plan.chunk_dense_mlps`): its [tokens, intermediate] activations are a chunk's, not the row's.
MLP_CHUNK_TOKENS = 1024


class PassEstimate(Protocol):
    """What `longest_row` reads of a pass's estimate (`bios.models.memory_plan.MemoryEstimate`)."""

    @property
    def total(self) -> int: ...

    @property
    def activations(self) -> int: ...

    @property
    def logits(self) -> int: ...

# Long lone rows, one pass after another, fragment glibc's heap: a 7.9k-token row of a 4-layer Llama
# (checkpointed, fp32) peaked at 809 MiB RSS in its first pass and settled at 893 MiB after four, 1.4x its
# estimated activations over the runtime (with MALLOC_MMAP_THRESHOLD_ fixed at 1 MiB: 594 MiB). The longest
# row is sized with this margin.
LONE_ROW_FRAGMENTATION = 1.5


def longest_row(sized: Callable[..., PassEstimate], usable_bytes: float, fits: int, context: int | None,
                shape: ModelShape | None = None, replicas: int = 1, streamed: bool = True, tp: int = 1) -> int:
    """The longest row `usable_bytes` of a worker hold (`fits`, the plan's pass, at least; the model's `context`,
    else 2^24, at most): run alone in a pass with activation checkpointing (`sized(batch_tokens=n)`, the plan's
    estimate so checkpointed), or, over `replicas` > 1 (`shape` given), split by sequence over them: each
    replica's share of the tokens, and what splitting adds to attention (`split_attention_bytes`: `streamed`
    on CPU, gathered elsewhere; each replica of `tp` workers).

    Estimates grow with a pass's tokens, so this doubles, then bisects. A row's pass counts as many tokens as a
    batch's: Bios's attention keeps O(length) per row (no [length, length] scores), so a pass's memory goes with
    its tokens, not with how they are cut into rows."""
    ceiling = context or 1 << 24

    def holds(tokens: int) -> bool:
        found = sized(batch_tokens=-(-tokens // replicas))
        split = split_attention_bytes(shape, tokens, replicas, streamed=streamed, tp=tp) \
            if shape is not None and replicas > 1 else 0
        row = found.activations + found.logits + split
        return found.total + split + (LONE_ROW_FRAGMENTATION - 1) * row <= usable_bytes

    low, high = min(fits, ceiling), None
    while high is None and low < ceiling:
        trial = min(low * 2, ceiling)
        low, high = (trial, None) if holds(trial) else (low, trial)
    while high is not None and high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if holds(middle) else (low, middle)
    return low


def split_attention_bytes(shape: ModelShape, tokens: int, replicas: int, *, streamed: bool = True,
                          tp: int = 1) -> int:
    """What a row of `tokens` split over `replicas` adds on each (`bios.worker.context_parallel`), fp32, beyond
    its share's own pass. Streamed (CPU), in a layer's backward: one source replica's keys and values and the
    kernel's gradients for them (four [key/value width, share]; the sums of those gradients stand in for the
    share's own), the kernel's query gradient and the merged output's temporaries (two [query width, share]):
    O(tokens / replicas). Gathered (elsewhere): the whole row's keys and values and their gradients, one
    gather's parts, and the attention's key buffers (six [head width, tokens] per thread): O(tokens). Under
    tensor parallelism (`tp` workers a replica) a worker holds its shard's heads: 1/tp of the widths."""
    if streamed:
        return (4 * shape.kv_size + 2 * shape.q_size) // tp * -(-tokens // replicas) * FP32
    return (5 * shape.kv_size // tp + 6 * shape.head_dim) * tokens * FP32


def kv_cache_bytes(shape: ModelShape, tokens: int, rows: int, tp: int = 1) -> int:
    """The keys and values a decode keeps: every layer's, for `rows` rows of `tokens` positions, fp32 (Bios keeps
    a low-precision model's cache in fp32 on CPU; an upper bound elsewhere), the heads split over `tp` workers."""
    return rows * tokens * shape.num_layers * 2 * shape.kv_size * FP32 // tp
