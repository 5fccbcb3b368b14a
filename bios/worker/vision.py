"""Image chunks made model inputs: token ids with the model's image tokens, pixel values and M-RoPE positions.

An `ImageChunk` of `expected_tokens` positions becomes that many image-pad tokens in the sequence, which the
model replaces with the vision tower's embeddings of the chunk's pixels. Rows of one batch carry their images
in row order; `model_kwargs` concatenates them and computes the 3-D (M-RoPE) position ids of the padded batch
explicitly, rather than letting the model keep them as state between calls (it caches `rope_deltas`, which
batches of other tenants' rows would then share).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from bios import images
from bios.model_input import EncodedTextChunk, ImageChunk, ModelInput


# Module path components of the image encoders and projectors of the vision-language families in Transformers.
_VISION_TOWER_PARTS = frozenset({"visual", "vision_tower", "vision_model", "multi_modal_projector"})


def in_vision_tower(module_name: str) -> bool:
    """Whether `module_name` lies in a vision-language model's image encoder (LoRA trains it only with
    `LoraConfig.train_vision`)."""
    return not _VISION_TOWER_PARTS.isdisjoint(module_name.split("."))


@dataclass(frozen=True)
class RowImages:
    """One row's images: patches [patches, features] and their grids [images, 3] (t, h, w), in order."""

    pixel_values: Tensor
    grid_thw: Tensor


@dataclass(frozen=True)
class ExpandedInput:
    """A model input as token ids, which positions hold image tokens, and its images (None: text only)."""

    tokens: Tensor  # [T] int64
    image_mask: Tensor  # [T] bool
    images: RowImages | None


class ImageReader:
    """Turns model inputs into token ids and pixel values for one vision-language base model."""

    def __init__(self, vision: images.VisionConfig, processor: Any) -> None:
        self.vision = vision
        self.processor = processor

    def expand(self, model_input: ModelInput, where: str) -> ExpandedInput:
        """ValueError naming the chunk for an image that does not decode or whose token count differs from
        `expected_tokens` (the coordinator refused those already; this guards the processor's arithmetic)."""
        pieces: list[Tensor] = []
        pixel_values: list[Tensor] = []
        grids: list[Tensor] = []
        for i, chunk in enumerate(model_input.chunks):
            if isinstance(chunk, EncodedTextChunk):
                pieces.append(torch.tensor(chunk.tokens, dtype=torch.int64))
                continue
            if not isinstance(chunk, ImageChunk):
                raise ValueError(f"{where}.chunks[{i}] is a {type(chunk).__name__}; workers take token and image "
                                 "chunks only")
            try:
                image = images.decode_image(chunk)
            except images.ImageError as exc:
                raise ValueError(f"{where}.chunks[{i}]: {exc}") from None
            processed = self.processor(images=[image], return_tensors="pt")
            grid = processed["image_grid_thw"].to(torch.int64)
            count = int(grid.prod()) // (self.vision.merge_size ** 2)
            if count != chunk.expected_tokens or count != images.image_token_count(self.vision, *image.size):
                raise ValueError(f"{where}.chunks[{i}]: the image processor makes {count} tokens of this "
                                 f"{image.width}x{image.height} image, expected_tokens is {chunk.expected_tokens}")
            pieces.append(torch.full((count,), self.vision.image_token_id, dtype=torch.int64))
            pixel_values.append(processed["pixel_values"])
            grids.append(grid)
        tokens = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
        row_images = RowImages(torch.cat(pixel_values), torch.cat(grids)) if grids else None
        return ExpandedInput(tokens, tokens == self.vision.image_token_id, row_images)

    def model_kwargs(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor,
                     rows: list[RowImages | None]) -> tuple[dict[str, Tensor], Tensor]:
        """The keyword arguments a padded batch needs besides ids and mask (pixel values, grids, 3-D position
        ids), and each row's rope delta [B] (its next position minus its length, for decoding)."""
        present = [row for row in rows if row is not None]
        grid = torch.cat([row.grid_thw for row in present]).to(input_ids.device) if present else None
        token_types = (input_ids == self.vision.image_token_id).to(torch.int32)
        position_ids, deltas = model.base_model.get_rope_index(
            input_ids, mm_token_type_ids=token_types, image_grid_thw=grid, attention_mask=attention_mask)
        kwargs: dict[str, Tensor] = {"position_ids": position_ids}
        if present:
            weights = model.get_input_embeddings().weight
            kwargs["pixel_values"] = torch.cat([row.pixel_values for row in present]).to(weights.device)
            kwargs["image_grid_thw"] = grid
        return kwargs, deltas.reshape(-1)


def image_reader(info: Any, processor: Any) -> ImageReader | None:
    """The reader of a loaded base model (`info`: its BaseModelInfo), None for a text-only model."""
    if info.vision is None:
        return None
    if processor is None:
        raise NotImplementedError(f"{info.name} is a vision-language model held without its image processor "
                                  "(tensor-parallel shards of vision-language models are not supported yet)")
    return ImageReader(info.vision, processor)
