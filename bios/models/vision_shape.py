"""A vision-language model's image encoder as memory sees it: its frozen weights and one pass's working set.

By default LoRA trains the language model only, so the vision tower runs with no tensor requiring a gradient
and autograd saves none of its activations (the activations a `train_vision` run saves in the tower are not
counted: such a run may need smaller passes than the plan's); what a pass costs is the transient working set of its blocks over the image's
patches (`merge_size`² patches per image token). The estimate is an upper bound by construction:

- every token of the pass is taken to be an image token (a pass holds at most `batch_tokens` image tokens);
- it is counted on top of the decoder's saved activations, although the tower runs (and frees its working
  set) before the first decoder layer;
- one block's widest moment per patch: its input and normed input, q/k/v and the rotated q/k, the attention
  output and its contiguous copy, the projection, the MLP's hidden (two copies around the activation, three
  for a gated MLP) and the block output, plus the fp32 patch pixels. Attention scores are not counted: the
  tower attends within each image through sdpa, whose fused kernels (CPU flash, CUDA flash/efficient) never
  materialise them.

Parameter counts are exact for the Qwen2-VL and Qwen2.5-VL towers; other families get theirs from the
safetensors headers of their model directory (`bios.models.model_shape.model_shape`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VisionTower:
    """The image encoder's size and the widths a pass over its patches holds at once."""

    parameters: int | None  # None: a family the arithmetic does not know (the weight files give it)
    width: int  # the blocks' embedding width
    mlp_width: int
    gated_mlp: bool
    patches_per_token: int  # spatial_merge_size²: the patches one image token merges
    pixels_per_patch: int  # in_channels x temporal_patch_size x patch_size²

    def activation_bytes(self, image_tokens: int, act_bytes: int) -> int:
        """Peak bytes of one pass over `image_tokens` image tokens' patches (see the module docstring)."""
        patches = image_tokens * self.patches_per_token
        per_patch = (10 * self.width + (3 if self.gated_mlp else 2) * self.mlp_width) * act_bytes
        return patches * (per_patch + 4 * self.pixels_per_patch)


def vision_tower(model_type: str, vision: Mapping[str, Any]) -> VisionTower:
    """The tower a `vision_config` describes, for a model of `model_type` (the top-level one, e.g. qwen2_vl)."""
    merge = int(vision.get("spatial_merge_size") or vision.get("merge_size") or 1)
    channels = int(vision.get("in_channels") or vision.get("in_chans") or vision.get("num_channels") or 3)
    patch = int(vision.get("patch_size") or 14)
    pixels = channels * int(vision.get("temporal_patch_size") or 1) * patch * patch
    if model_type == "qwen2_vl":
        width = int(vision["embed_dim"])
        mlp = int(width * vision.get("mlp_ratio", 4))
        block = 4 * width * width + 2 * width * mlp + 9 * width + mlp  # 2 LayerNorms, qkv + proj, fc1 + fc2
        merger = 2 * width + _merger_mlp(width * merge * merge, int(vision["hidden_size"]))
        return VisionTower(pixels * width + int(vision["depth"]) * block + merger, width, mlp, False, merge**2, pixels)
    if model_type == "qwen2_5_vl":
        width, mlp = int(vision["hidden_size"]), int(vision["intermediate_size"])
        block = 4 * width * width + 3 * width * mlp + 7 * width + 2 * mlp  # 2 RMSNorms, qkv + proj, biased SwiGLU
        merger = width + _merger_mlp(width * merge * merge, int(vision["out_hidden_size"]))
        return VisionTower(pixels * width + int(vision["depth"]) * block + merger, width, mlp, True, merge**2, pixels)
    width = int(vision.get("embed_dim") or vision["hidden_size"])
    mlp = int(vision.get("intermediate_size") or width * vision.get("mlp_ratio", 4))
    return VisionTower(None, width, mlp, True, merge**2, pixels)


def _merger_mlp(merged: int, out: int) -> int:
    """The patch merger's two biased linears: merged -> merged -> the language model's width."""
    return merged * merged + merged + merged * out + out
