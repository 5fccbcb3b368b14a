"""Frozen weights kept in oneDNN's own blocked layout for decode steps on CPU.

oneDNN's linear reorders a plain [out, in] weight into its blocked layout on every call; for a decode step's
few rows that reorder is a large part of the product (16 rows, AMD EPYC, 2 threads: SmolLM2's 60 gate/up
projections 19.8 -> 15.7 ms in fp32, 15.5 -> 8.0 ms in bf16; its 49152 x 576 head 10.1 -> 6.5 ms), and a
sampling step is little more than those products. `prepacked_weights()` (entered by the sampler around its
decode steps) lets `frozen_matmul` multiply by a reordered copy of each weight, made on first use
(`torch.ops.mkldnn._reorder_linear_weight`, the reorder Inductor's frozen CPU graphs use) and kept on the weight
for later steps. The results are oneDNN's own, bit for bit those of the plain weight for 5 or more rows.

A copy costs the weight's size again, so copies are made only while they stay within a quarter of the machine's
memory and half of what is free when each is made; the rest multiply as before. `BIOS_PREPACK=off` makes none.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import psutil
import torch

_ACTIVE: ContextVar[bool] = ContextVar("bios_prepacked_weights", default=False)
_ATTRIBUTE = "_bios_prepacked"  # on the weight: ((data pointer, version), prepacked copy)
_DTYPES = (torch.float32, torch.bfloat16)
# The rows oneDNN lays the copy out for. A hint of 1 picks a layout no faster than the plain weight; any of 8 to
# 256 ran 8 to 256 rows alike (fp32, 1536 x 576), so one fixed hint serves every batch size.
_ROWS_HINT = 16
_held: dict[int, int] = {}  # id(weight) -> bytes of its copy, while the weight lives


def prepack_setting() -> str:
    """`BIOS_PREPACK` (unset: "auto"): whether decode steps may keep prepacked copies of frozen weights."""
    value = os.environ.get("BIOS_PREPACK", "").strip().lower() or "auto"
    if value not in ("auto", "off"):
        raise ValueError(f"BIOS_PREPACK must be 'auto' or 'off' (unset: auto), got {value!r}")
    return value


@contextmanager
def prepacked_weights() -> Iterator[None]:
    """Within this block (a sampler's decode steps), `prepacked(weight)` may make and return prepacked copies."""
    token = _ACTIVE.set(prepack_setting() == "auto")
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def prepacked_bytes() -> int:
    """Bytes held by the prepacked copies of weights that are still alive (the worker's log)."""
    return sum(_held.values())


def prepacked(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """The prepacked copy of `weight` to multiply `x` by inside `prepacked_weights()`, made now if need be;
    None outside it, off the CPU, for other dtypes, or when the copy would not fit."""
    if not _ACTIVE.get() or not _eligible(x, weight):
        return None
    key = (weight.data_ptr(), weight._version)
    cached = getattr(weight, _ATTRIBUTE, None)
    if cached is not None:
        if cached[0] == key:
            return cached[1]
        delattr(weight, _ATTRIBUTE)  # the weight changed in place: its copy is stale
        _held.pop(id(weight), None)
    nbytes = weight.numel() * weight.element_size()
    if not _fits(nbytes):
        return None
    copy = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _ROWS_HINT)
    setattr(weight, _ATTRIBUTE, (key, copy))
    _held[id(weight)] = nbytes
    weakref.finalize(weight, _held.pop, id(weight), None)
    return copy


def _eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype == weight.dtype
            and weight.dtype in _DTYPES and weight.dim() == 2 and not weight.requires_grad
            and torch.backends.mkldnn.is_available())


def _fits(nbytes: int) -> bool:
    memory = psutil.virtual_memory()
    return prepacked_bytes() + nbytes <= memory.total // 4 and nbytes <= memory.available // 2
