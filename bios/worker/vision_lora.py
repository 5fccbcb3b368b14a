"""LoRA on a vision-language model's image encoder (`LoraConfig.train_vision`): which adapter each patch uses.

`active_adapters` gives each batch row its adapter along dim 0 of every layer input. The vision tower has no
batch axis: it sees the patches of every row's images concatenated in row order, and its merger layers see
them merged `merge_size x merge_size` to one. So within `tower_adapters`, each LoRA layer of the tower takes
its segments, per call, from the share of its input rows that each batch row's patches make up.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor, nn

from bios.worker.adapter import AdapterState
from bios.worker.lora import LoraSegment
from bios.worker.vision import RowImages, in_vision_tower


def tower_lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The vision tower's layers that carry LoRA segments (after `attach_lora`), by module path."""
    return {name: module for name, module in model.named_modules()
            if in_vision_tower(name) and hasattr(module, "lora_segments")}


@contextmanager
def tower_adapters(model: nn.Module, rows: list[RowImages | None],
                   adapters: list[AdapterState | None]) -> Iterator[None]:
    """Within the block, the patches of row i's images go through the tower's LoRA layers with `adapters[i]`
    (None: the base model; rows without images have no patches). A no-op unless some adapter trains the tower."""
    trained = {id(adapter): adapter for adapter in adapters if adapter is not None and adapter.config.train_vision}
    if not trained:
        yield
        return
    layers = {name: module for name, module in tower_lora_layers(model).items()
              if any(adapter.has_target(name) for adapter in trained.values())}
    spans: list[tuple[int, int, AdapterState]] = []
    total = 0
    for row, adapter in zip(rows, adapters, strict=True):
        if row is not None:
            patches = int(row.pixel_values.shape[0])
            if adapter is not None:
                spans.append((total, total + patches, adapter))
            total += patches
    if not layers or not spans:
        yield
        return

    def hook_for(name: str):
        def set_segments(module: nn.Module, args: tuple[Tensor, ...]) -> None:
            inputs = int(args[0].shape[0])
            if any(boundary * inputs % total for start, end, _ in spans for boundary in (start, end)):
                raise RuntimeError(f"{name} sees {inputs} rows for {total} image patches; LoRA on the vision tower "
                                   "needs each layer's input rows to be the patches (or merged patches) in order")
            module.lora_segments = [
                LoraSegment(start * inputs // total, end * inputs // total, *adapter.lora_pair(name), adapter.scale)
                for start, end, adapter in spans if adapter.has_target(name)
            ]
        return set_segments

    saved = {name: module.lora_segments for name, module in layers.items()}
    handles = [module.register_forward_pre_hook(hook_for(name)) for name, module in layers.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for name, module in layers.items():
            module.lora_segments = saved[name]
