"""Frozen weights in oneDNN's own blocked layout for the sampler's decode steps on CPU.

oneDNN's linear reorders a plain [out, in] weight into its blocked layout on every call; for a decode step's
few rows that reorder is a large part of the product (16 rows, AMD EPYC, 2 threads: SmolLM2's 60 gate/up
projections 19.8 -> 15.7 ms in fp32, 15.5 -> 8.0 ms in bf16; its 49152 x 576 head 10.1 -> 6.5 ms), and a
sampling step is little more than those products. Inside a `PrepackedWeights.using()` block (the sampler's
decode loop) `frozen_matmul` multiplies by a reordered copy of each weight (`torch.ops.mkldnn._reorder_linear_weight`, the
reorder Inductor's frozen CPU graphs use), made on first use: one reorder per weight, against one per
product. The results are oneDNN's own, bit for bit those of the plain weight for 5 or more rows.

A copy costs its weight's size again and, in fp32, time: SmolLM2's take ~0.7 s to make (mostly first touches
of fresh pages), ~12 ms of each of 64 decode steps if remade every call. So a `PrepackedWeights` keeps them
from one sampling call to the next, making new ones within half of the memory free when a call starts, until
its owner (the worker's cycle executor) releases them before a training pass needs the memory. A copy goes
with its weight when the model is dropped. `BIOS_PREPACK=off` makes none.

Sampling with an adapter (RL's case) adds two rank-r products per layer, `x Aᵀ` and its `Bᵀ`, whose per-call
cost on a decode step's 16 rows made SmolLM2's fp32 step ~1.3x the base model's (211 adapted layers). In a block
the sampler opens with `adapter=True` (every row one adapter), a copy holds `W + scale·B·A` instead
(`prepacked(..., lora_a=, lora_b=, scale=)`), made once per version of the adapter's factors: the step then costs
what the base model's does. Only in fp32: a bf16 sum would round a young adapter's small update away (each
element's change under half a unit in the last place of W's is lost), where adding the low-rank product to the
output keeps it. In bf16 the copy stacks A under W instead (`prepacked(..., lora_a=)`, `[W; A]`): one product
gives `x Wᵀ` and `x Aᵀ`, and only the `Bᵀ` product stays a call of its own (SmolLM2, 16 x 64: 79.4 -> 75.0 ms a
step, the same tokens).

On Intel CPUs an fp32 copy is MKL's packed sgemm weight instead (`MklPack`): a decode step's weight products
there took 28.0 / 32.6 / 39.0 / 50.0 / 68.8 ms for 4 / 8 / 16 / 32 / 64 rows against oneDNN's copies' 31.6 /
36.7 / 45.8 / 57.9 / 91.8 (SmolLM2, Intel Xeon, 2 threads). MKL packs a weight for one row count, so the sampler
opens a block with its batch's rows (`using(rows=)`), rounded up to 4, 8, 16 or a multiple of 16
(`_mkl_pack_rows`): fewer rows (a smaller batch, or finished rows dropped) are padded up to it, and only a block
that needs another size remakes the copies (SmolLM2: ~0.7 s). One or two rows take no copy: MKL's own product of
the plain weight ran them fastest (20.9 / 22.3 ms; packed 22.9 / 23.8, oneDNN's copies 29.6 / 31.3).
`BIOS_GEMM=onednn` keeps oneDNN's copies there too.

Where the machine's C compiler builds it, an fp32 copy for a block of 5 to 32 rows is the row kernel's pack
instead (`bios.kernels.row_gemm.RowGemmPack`, on any x86 CPU with AVX2): it streams a weight faster than MKL's
packs (SmolLM2's layers at 16 rows: 23-25 against 29 ms on the Intel Xeon) and serves any row count, so a block's
rows change nothing. MKL's packs and oneDNN's copies keep the other row counts, and every copy where it cannot
be built (`BIOS_C_KERNELS=off` too).

Weights that multiply the same input (a Llama layer's q, k and v; its gate and up) can share one copy, stacked
by output rows (`prepacked_stack`): one product and one call instead of three or two. SmolLM2's layers' products,
fp32, 16 rows streamed from memory as in a decode step: 27.5 -> 26.9 ms; the lean decode step
(`bios.worker.llama_decode`) also saves the calls.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cache
from typing import NamedTuple

import psutil
import torch

from bios.kernels import gemm_choice, row_gemm
from bios.kernels.row_gemm import RowGemmPack

# The rows oneDNN lays a copy out for. A hint of 1 picks a layout no faster than the plain weight; any of 8 to
# 256 ran 8 to 256 rows alike (fp32, 1536 x 576), so one fixed hint serves every batch size.
_ROWS_HINT = 16
# Below this many rows a block makes no MKL packs (the plain weight's product is faster: module docstring).
_MKL_MIN_ROWS = 3


class PrepackedWeights:
    """Prepacked copies of frozen weights, made inside `using()` blocks and kept from one block to the next until
    `release()` (or until their weight is freed). Their owner releases them before anything else needs the
    memory: the worker's cycle executor before a training pass."""

    def __init__(self) -> None:
        # (id of the weight's owner, its view, the update's factors and scale or None) -> what is held. The owner
        # is the tensor a view was taken of (GPT-2's Conv1D passes `weight.T`, a new view each call), else the
        # weight itself.
        self._copies: dict[tuple, _Held] = {}
        self._room = 0  # bytes more copies may take in the current `using()` block
        self._adapter_copies = False  # whether the current block makes and uses copies with an adapter in them
        self._adapter_keys_used: set[tuple] = set()  # the keys of such copies the current block used
        self._mkl_rows: int | None = _ROWS_HINT  # the rows MKL packs are made for in the current block, if any
        self._row_gemm = False  # whether the current block's fp32 copies are `RowGemmPack`s

    @contextmanager
    def using(self, *, adapter: bool = False, rows: int = _ROWS_HINT) -> Iterator[None]:
        """Within this block `prepacked(x, weight)` returns copies, making new ones within half of the memory
        free when it starts. With `adapter` (the sampler's call when every row uses one adapter for long enough
        to repay the copies) also copies with that adapter in them; those of other adapters, or of none used
        in the block, are dropped when it ends, so at most one adapter's are kept. `rows`: the most rows a
        product in the block has (MKL packs are made for it)."""
        if prepack_setting() == "off":
            self.release()
            token = _ACTIVE.set(None)
        else:
            self._room = psutil.virtual_memory().available // 2
            self._adapter_copies, self._adapter_keys_used = adapter, set()
            self._mkl_rows = _mkl_pack_rows(rows)
            self._row_gemm = row_gemm.suits(rows)
            token = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)
            for key in [key for key, held in self._copies.items()
                        if held.version is not None and key not in self._adapter_keys_used]:
                del self._copies[key]
            self._adapter_copies = False

    def release(self) -> None:
        self._copies.clear()

    def held_bytes(self) -> int:
        return sum(held.nbytes for held in self._copies.values())

    def _copy(self, weights: tuple[torch.Tensor, ...], updates: tuple[LoraUpdate | None, ...]
              ) -> torch.Tensor | MklPack | RowGemmPack | None:
        """The copy of `weights` stacked by output rows (each with its update in it, if given), made now if it has
        none and one fits in this block's room; else None. A copy made from older versions of the updates' factors
        is replaced. It goes with its first weight (a stack's weights are one layer's, freed together) and with its
        first update's A (an adapter's factors go together)."""
        adapted = [update for update in updates if update is not None]
        if adapted and not self._adapter_copies:
            return None
        owners = tuple(weight if weight._base is None else weight._base for weight in weights)
        key = tuple((id(owner), tuple(weight.shape), weight.stride(), weight.storage_offset(),
                     None if update is None else (*map(id, update.factors()), update.scale))
                    for owner, weight, update in zip(owners, weights, updates))
        version = tuple(0 if f.is_inference() else f._version for update in adapted for f in update.factors()) or None
        if adapted:
            self._adapter_keys_used.add(key)
        held = self._copies.get(key)
        first = weights[0]
        kind = self._kind(first.dtype)
        if (held is not None and held.owner() is owners[0] and held.version == version
                and type(held.copy) is kind and (kind is not MklPack or held.copy.rows == self._mkl_rows)):
            return held.copy
        if kind is None:
            return None
        plain_rows = sum(weight.shape[0] for weight in weights)
        stacked_rows = sum(update.lora_a.shape[0] for update in adapted if update.lora_b is None)
        nbytes = (plain_rows + stacked_rows) * first.shape[1] * first.element_size()
        if held is not None:
            self._copies.pop(key)
            self._room += held.nbytes
        if nbytes > self._room:
            return None
        plain = _plain(weights, updates).contiguous()
        if kind is RowGemmPack:
            copy = row_gemm.pack(plain)
        elif kind is MklPack:
            copy = MklPack(torch.ops.mkl._mkl_reorder_linear_weight(plain, self._mkl_rows),
                           first.new_empty(()).expand(plain_rows, first.shape[1]), self._mkl_rows)
        else:
            copy = torch.ops.mkldnn._reorder_linear_weight(plain, _ROWS_HINT)
        drop = lambda _, key=key: self._copies.pop(key, None)  # noqa: E731
        self._copies[key] = _Held(weakref.ref(owners[0], drop), copy, nbytes, version,
                                  weakref.ref(adapted[0].lora_a, drop) if adapted else None)
        self._room -= nbytes
        return copy

    def _kind(self, dtype: torch.dtype) -> type | None:
        """What a copy of a weight in `dtype` is in the current block: a `RowGemmPack` for fp32 where the row
        kernel suits the block's rows, else an `MklPack` for fp32 on Intel CPUs (None: no copy, too few rows), else
        oneDNN's blocked tensor."""
        if dtype != torch.float32:
            return torch.Tensor
        if self._row_gemm:
            return RowGemmPack
        if mkl_packs():
            return None if self._mkl_rows is None else MklPack
        return torch.Tensor


def _plain(weights: tuple[torch.Tensor, ...], updates: tuple[LoraUpdate | None, ...]) -> torch.Tensor:
    """What a copy lays out: the weights (each `W` or `W + scale·B·A`) stacked by output rows, then the A factors
    of the updates that stack theirs (`[W; A]`)."""
    parts = [weight.detach() if update is None or update.lora_b is None
             else torch.addmm(weight.detach(), update.lora_b.detach(), update.lora_a.detach(), alpha=update.scale)
             for weight, update in zip(weights, updates)]
    parts += [update.lora_a.detach() for update in updates if update is not None and update.lora_b is None]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _mkl_pack_rows(rows: int) -> int | None:
    """The rows MKL packs are made for in a block of `rows` rows: 4, 8, 16 or a multiple of 16 (a padded row costs
    little among a decode step's few, a remade copy ~10 steps); None (no packs) below `_MKL_MIN_ROWS`."""
    if rows < _MKL_MIN_ROWS:
        return None
    return 1 << max(2, (rows - 1).bit_length()) if rows <= 16 else -(-rows // 16) * 16


class MklPack(NamedTuple):
    """A weight (or `W + scale·B·A`, or several stacked) packed by MKL for products of exactly `rows` rows."""

    packed: torch.Tensor
    weight: torch.Tensor  # the product's [out, in] shape, for the op (expanded from one element: never read)
    rows: int

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`x Wᵀ + b` for x [..., in]: fewer rows padded up to `rows`, more taken `rows` at a time."""
        flat = x.reshape(-1, x.shape[-1])
        total = flat.shape[0]
        if total == self.rows:
            result = self._product(flat, bias)
        else:
            parts = []
            for start in range(0, total, self.rows):
                part = flat[start : start + self.rows]
                if part.shape[0] < self.rows:
                    part = torch.cat([part, part.new_zeros(self.rows - part.shape[0], part.shape[1])])
                parts.append(self._product(part, bias))
            result = torch.cat(parts)[:total]
        return result.reshape(*x.shape[:-1], result.shape[-1])

    def _product(self, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkl._mkl_linear(rows, self.packed, self.weight, bias, self.rows)


@dataclass
class _Held:
    owner: weakref.ref  # the tensor the weight is (a view of); the copy goes with it
    copy: torch.Tensor | MklPack | RowGemmPack
    nbytes: int
    version: tuple[int, ...] | None  # the versions of the factors the copy was made from
    factor: weakref.ref | None  # the update's A; the copy also goes with it (its adapter was dropped)


_ACTIVE: ContextVar[PrepackedWeights | None] = ContextVar("bios_prepacked_weights", default=None)


def prepacking() -> bool:
    """Whether a `PrepackedWeights.using()` block is active here (a decode step's products take copies)."""
    return _ACTIVE.get() is not None


def prepack_setting() -> str:
    """`BIOS_PREPACK` (unset: "auto"): whether decode steps multiply by prepacked copies of frozen weights."""
    value = os.environ.get("BIOS_PREPACK", "").strip().lower() or "auto"
    if value not in ("auto", "off"):
        raise ValueError(f"BIOS_PREPACK must be 'auto' or 'off' (unset: auto), got {value!r}")
    return value


def mkl_packs() -> bool:
    """Whether fp32 copies are MKL packs (see the module docstring): on Intel CPUs, unless `BIOS_GEMM=onednn`."""
    return gemm_choice.intel_cpu() and torch.backends.mkl.is_available() and gemm_choice.gemm_backend() != "onednn"


def prepacked(x: torch.Tensor, weight: torch.Tensor, *, lora_a: torch.Tensor | None = None,
              lora_b: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor | MklPack | RowGemmPack | None:
    """The prepacked copy of `weight` to multiply `x` by inside a `PrepackedWeights.using()` block, made now if
    need be; None outside one, off the CPU, for other dtypes, or once the block's room is used up. Given LoRA
    factors (A [r, in], B [out, r]) the copy of `weight + scale·B·A`, fp32 only; given A alone the copy of
    `[weight; A]` ([out + r, in]), in the weight's dtype (see the module docstring)."""
    update = None if lora_a is None else LoraUpdate(lora_a, lora_b, float(scale))
    return prepacked_stack(x, [weight], [update])


class LoraUpdate(NamedTuple):
    """What a copy holds besides its weight: `scale·B·A` added to it, or (lora_b None) A stacked under it."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor | None
    scale: float

    def factors(self) -> tuple[torch.Tensor, ...]:
        return (self.lora_a,) if self.lora_b is None else (self.lora_a, self.lora_b)


def prepacked_stack(x: torch.Tensor, weights: list[torch.Tensor], updates: list[LoraUpdate | None]
                    ) -> torch.Tensor | MklPack | RowGemmPack | None:
    """`prepacked` for several weights that multiply the same `x` (q, k and v; gate and up), stacked by output
    rows: one product gives every output side by side, each weight with its own update (or none) in it, and
    the A factors of stacked updates (`lora_b` None) after all the weights' rows."""
    keeper = _ACTIVE.get()
    if keeper is None or not all(_eligible(x, weight) for weight in weights):
        return None
    dtype = weights[0].dtype
    if any(update is not None and (update.lora_a.dtype != dtype or (update.lora_b is not None and (
            not merges(dtype) or update.lora_b.dtype != dtype))) for update in updates):
        return None
    return keeper._copy(tuple(weights), tuple(updates))


def merges(dtype: torch.dtype) -> bool:
    """Whether a copy in `dtype` may hold `W + scale·B·A`: fp32 only, as a bf16 sum rounds a young adapter's small
    update away (see the module docstring); copies in other dtypes stack `[W; A]`."""
    return dtype == torch.float32


def _eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype == weight.dtype
            and weight.dim() == 2 and not weight.requires_grad and weight.dtype in _supported_dtypes())


@cache
def _supported_dtypes() -> tuple[torch.dtype, ...]:
    """fp32 wherever PyTorch has oneDNN; bf16 only where oneDNN runs it (AVX-512 or AVX-NE-CONVERT: an AVX2-only
    CPU, or one held to AVX2 by `ONEDNN_MAX_CPU_ISA`, refuses to reorder a bf16 weight)."""
    if not torch.backends.mkldnn.is_available():
        return ()
    return (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)
