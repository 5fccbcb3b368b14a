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
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache

import psutil
import torch

# The rows oneDNN lays a copy out for. A hint of 1 picks a layout no faster than the plain weight; any of 8 to
# 256 ran 8 to 256 rows alike (fp32, 1536 x 576), so one fixed hint serves every batch size.
_ROWS_HINT = 16


class PrepackedWeights:
    """Prepacked copies of frozen weights, made inside `using()` blocks and kept from one block to the next until
    `release()` (or until their weight is freed). Their owner releases them before anything else needs the
    memory: the worker's cycle executor before a training pass."""

    def __init__(self) -> None:
        # (id of the weight's owner, its view) -> (owner, copy, bytes). The owner is the tensor a view was taken
        # of (GPT-2's Conv1D passes `weight.T`, a new view each call), else the weight itself.
        self._copies: dict[tuple, tuple[weakref.ref, torch.Tensor, int]] = {}
        self._room = 0  # bytes more copies may take in the current `using()` block

    @contextmanager
    def using(self) -> Iterator[None]:
        """Within this block `prepacked(x, weight)` returns copies, making new ones within half of the memory
        free when it starts."""
        if prepack_setting() == "off":
            self.release()
            token = _ACTIVE.set(None)
        else:
            self._room = psutil.virtual_memory().available // 2
            token = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)

    def release(self) -> None:
        self._copies.clear()

    def held_bytes(self) -> int:
        return sum(nbytes for _, _, nbytes in self._copies.values())

    def _copy(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The copy of `weight`, made now if it has none and one fits in this block's room; else None."""
        owner = weight if weight._base is None else weight._base
        key = (id(owner), tuple(weight.shape), weight.stride(), weight.storage_offset())
        held = self._copies.get(key)
        if held is not None and held[0]() is owner:
            return held[1]
        nbytes = weight.numel() * weight.element_size()
        if nbytes > self._room:
            return None
        copy = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _ROWS_HINT)
        self._copies[key] = (weakref.ref(owner, lambda _, key=key: self._copies.pop(key, None)), copy, nbytes)
        self._room -= nbytes
        return copy


_ACTIVE: ContextVar[PrepackedWeights | None] = ContextVar("bios_prepacked_weights", default=None)


def prepack_setting() -> str:
    """`BIOS_PREPACK` (unset: "auto"): whether decode steps multiply by prepacked copies of frozen weights."""
    value = os.environ.get("BIOS_PREPACK", "").strip().lower() or "auto"
    if value not in ("auto", "off"):
        raise ValueError(f"BIOS_PREPACK must be 'auto' or 'off' (unset: auto), got {value!r}")
    return value


def prepacked(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """The prepacked copy of `weight` to multiply `x` by inside a `PrepackedWeights.using()` block, made now if
    need be; None outside one, off the CPU, for other dtypes, or once the block's room is used up."""
    keeper = _ACTIVE.get()
    if keeper is None or not _eligible(x, weight):
        return None
    return keeper._copy(weight)


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
