"""Images as a vision-language model sees them: decoded bytes, and how many tokens each one becomes.

The coordinator checks `expected_tokens` of every image chunk at acceptance and the workers turn the same
chunks into pixel values; both count tokens with `image_token_count`, the one rule, computed from the model's
image processor config (`VisionConfig`) with no torch. Decoding uses Pillow only.

The count is the Qwen2-VL family's (Qwen2.5-VL and Qwen3-VL share its image processor): the image is
resized so both sides are multiples of `patch_size * merge_size` and its area lies in [min_pixels,
max_pixels] (`smart_resize`, as in Transformers), cut into `patch_size` patches, and every `merge_size x
merge_size` patches become one token.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from bios.model_input import IMAGE_FORMATS, ImageAssetPointerChunk, ImageChunk, ModelInput

# Model types whose image processor and position scheme Bios implements (and tests). All four use Transformers'
# Qwen2VLImageProcessor, so one token-count rule serves them; their M-RoPE positions come from the model itself.
VISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
# Refuse to decode anything larger than this before allocating it (a decompression bomb is a tiny PNG).
MAX_IMAGE_PIXELS = 64 * 1024 * 1024
_MAX_ASPECT_RATIO = 200
_PIL_FORMATS = {"png": "PNG", "jpeg": "JPEG"}


class ImageError(ValueError):
    """An image that cannot be used: undecodable, not in its declared format, or too large."""


@dataclass(frozen=True)
class VisionConfig:
    """What counting and placing a model's image tokens needs: its image token and its processor's geometry."""

    model_type: str
    image_token_id: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int


@dataclass(frozen=True)
class ImageGrid:
    """How an image is cut: `height` x `width` patches (before merging) and the tokens that makes."""

    height: int
    width: int
    merge_size: int

    @property
    def tokens(self) -> int:
        return self.height * self.width // (self.merge_size * self.merge_size)


def read_vision_config(directory: Path) -> VisionConfig | None:
    """The vision config of the model in `directory`; None for a text-only model (no `vision_config`)."""
    config = json.loads((directory / "config.json").read_text())
    processor_file = directory / "preprocessor_config.json"
    processor = json.loads(processor_file.read_text()) if processor_file.is_file() else None
    return vision_config_from(config, processor, str(directory))


def vision_config_from(config: dict, processor: dict | None, where: str) -> VisionConfig | None:
    """From a `config.json` dict and a `preprocessor_config.json` dict (None if absent) of the model at `where`."""
    if "vision_config" not in config:
        return None
    model_type = str(config.get("model_type"))
    if model_type not in VISION_MODEL_TYPES:
        raise NotImplementedError(
            f"{where} is a {model_type} vision-language model; Bios runs images on {', '.join(VISION_MODEL_TYPES)} "
            "models only")
    if processor is None:
        raise ValueError(f"{where} is a vision-language model but has no preprocessor_config.json (its image "
                         "processor config, as the processor's save_pretrained writes it)")
    size = processor.get("size") or {}
    return VisionConfig(
        model_type=model_type,
        image_token_id=int(config["image_token_id"]),
        patch_size=int(processor["patch_size"]),
        merge_size=int(processor["merge_size"]),
        temporal_patch_size=int(processor["temporal_patch_size"]),
        min_pixels=int(processor.get("min_pixels") or size["shortest_edge"]),
        max_pixels=int(processor.get("max_pixels") or size["longest_edge"]),
    )


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The size an image is resized to: sides multiples of `factor`, area in range, aspect ratio nearly kept."""
    if max(height, width) / min(height, width) > _MAX_ASPECT_RATIO:
        raise ImageError(f"a {width}x{height} image is too elongated: the aspect ratio must be at most "
                         f"{_MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_grid(vision: VisionConfig, width: int, height: int) -> ImageGrid:
    """The patch grid of a `width` x `height` image under `vision`'s processor."""
    h, w = smart_resize(height, width, vision.patch_size * vision.merge_size, vision.min_pixels, vision.max_pixels)
    return ImageGrid(h // vision.patch_size, w // vision.patch_size, vision.merge_size)


def image_token_count(vision: VisionConfig, width: int, height: int) -> int:
    return image_grid(vision, width, height).tokens


def decode_image(chunk: ImageChunk):  # -> PIL.Image.Image (Pillow is imported lazily)
    """The chunk's image, fully decoded as RGB; ImageError if its bytes are not a whole image of its format."""
    from PIL import Image, UnidentifiedImageError

    if chunk.format not in IMAGE_FORMATS:
        raise ImageError(f"image format {chunk.format!r} is not supported; use one of {', '.join(IMAGE_FORMATS)}")
    try:
        image = Image.open(io.BytesIO(chunk.data), formats=[_PIL_FORMATS[chunk.format]])
    except UnidentifiedImageError:
        raise ImageError(f"the {len(chunk.data)} bytes are not a {chunk.format} image") from None
    if image.width * image.height > MAX_IMAGE_PIXELS:
        raise ImageError(f"a {image.width}x{image.height} image exceeds the limit of {MAX_IMAGE_PIXELS} pixels")
    try:
        image.load()
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageError(f"the {chunk.format} image is corrupt or truncated: {exc}") from None
    return image.convert("RGB")


def read_pointer(chunk: ImageAssetPointerChunk) -> ImageChunk:
    """The image a pointer names, read from this host's disk (a path or `file://` URL; never the network)."""
    parsed = urlparse(chunk.location)
    if parsed.scheme not in ("", "file"):
        raise ImageError(f"image location {chunk.location!r} is a {parsed.scheme} URL; Bios reads images from local "
                         "paths or file:// URLs only (send remote images as ImageChunk bytes)")
    path = Path(unquote(parsed.path) if parsed.scheme == "file" else chunk.location)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ImageError(f"cannot read image {path}: {exc.strerror}") from None
    return ImageChunk(data=data, format=chunk.format, expected_tokens=chunk.expected_tokens)


def read_pointers(model_input: ModelInput, where: str) -> ModelInput:
    """`model_input` with each image pointer replaced by the image it names (itself if it holds none);
    ImageError naming the chunk (`where.chunks[i]`) for one that cannot be read."""
    if not any(isinstance(chunk, ImageAssetPointerChunk) for chunk in model_input.chunks):
        return model_input
    chunks = []
    for i, chunk in enumerate(model_input.chunks):
        if isinstance(chunk, ImageAssetPointerChunk):
            try:
                chunk = read_pointer(chunk)
            except ImageError as exc:
                raise ImageError(f"{where}.chunks[{i}]: {exc}") from None
        chunks.append(chunk)
    return ModelInput(chunks=chunks)
