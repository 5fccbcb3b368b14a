"""Tiny random vision-language models of the Qwen2.5-VL and Qwen3-VL families, written from a config with the
built-in byte tokenizer plus the vision tokens and an image processor config, for the family tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForImageTextToText
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from bios.models.builtin import byte_level_tokenizer
from bios.models.cache import save_model_files
from bios.models.catalog import (
    BOS, BUILTIN_VOCAB_SIZE, BYTE_VOCAB_SIZE, EOS, PAD, SPECIAL_TOKENS, VISION_TOKENS,
)


def _vision_token(token: str) -> int:
    return BUILTIN_VOCAB_SIZE + VISION_TOKENS.index(token)


_TEXT = dict(
    vocab_size=BUILTIN_VOCAB_SIZE + len(VISION_TOKENS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
    bos_token_id=BYTE_VOCAB_SIZE + SPECIAL_TOKENS.index(BOS), eos_token_id=BYTE_VOCAB_SIZE + SPECIAL_TOKENS.index(EOS),
    pad_token_id=BYTE_VOCAB_SIZE + SPECIAL_TOKENS.index(PAD),
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
)
_TOKENS = dict(
    vision_start_token_id=_vision_token("<|vision_start|>"), vision_end_token_id=_vision_token("<|vision_end|>"),
    image_token_id=_vision_token("<|image_pad|>"), video_token_id=_vision_token("<|video_pad|>"),
    tie_word_embeddings=False,
)
_MOE_TEXT = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1)
# 4x4-pixel patches merged 2x2: a 16x16 image is 4 tokens; images are resized to between 16x16 and 32x32 pixels.
_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32, patch_size=4,
               spatial_merge_size=2, temporal_patch_size=2)
CONFIGS = {
    "qwen2_5_vl": dict(text_config=_TEXT, vision_config=dict(_VISION, window_size=16, fullatt_block_indexes=[1]),
                       **_TOKENS),
    "qwen3_vl": dict(
        text_config=dict(_TEXT, rope_parameters=dict(_TEXT["rope_parameters"], mrope_interleaved=True)),
        vision_config=dict(_VISION, num_position_embeddings=64, deepstack_visual_indexes=[0]), **_TOKENS),
    "qwen3_vl_moe": dict(
        text_config=dict(_TEXT, **_MOE_TEXT,
                         rope_parameters=dict(_TEXT["rope_parameters"], mrope_interleaved=True)),
        vision_config=dict(_VISION, num_position_embeddings=64, deepstack_visual_indexes=[0]), **_TOKENS),
}
PROCESSOR = dict(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16, max_pixels=32 * 32)
IMAGE_TOKEN_ID = _TOKENS["image_token_id"]


def write_vlm(model_type: str, directory: Path, *, seed: int = 0, std: float = 0.08) -> Path:
    """A tiny `model_type` vision-language model with every weight matrix drawn with `std`, saved as a Hugging
    Face directory with the byte tokenizer, the vision tokens and its image processor config."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, dtype="float32", **CONFIGS[model_type])
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim >= 2:
                param.normal_(0.0, std)
    save_model_files(model, directory)
    byte_level_tokenizer(VISION_TOKENS).save_pretrained(directory)
    Qwen2VLImageProcessorPil(**PROCESSOR).save_pretrained(directory)
    return directory
