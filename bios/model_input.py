"""What a model reads: a sequence of chunks, token ids and images, as in Tinker 0.38's `ModelInput`.

An image chunk stands for `expected_tokens` positions of the sequence (the model's image tokens), so
`ModelInput.length` and the per-token `loss_fn_inputs` count them. `ImageAssetPointerChunk` names an image file
the coordinator reads (a local path or `file://` URL; Bios never fetches over the network); it becomes an
`ImageChunk` at acceptance, so workers only ever see bytes. Plain dataclasses: these cross the wire through
`bios.transport.codec` and are re-exported by `bios.types`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence, Union

ImageFormat = Literal["png", "jpeg"]
IMAGE_FORMATS: tuple[str, ...] = ("png", "jpeg")


@dataclass(frozen=True)
class EncodedTextChunk:
    tokens: list[int]
    type: Literal["encoded_text"] = "encoded_text"

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class ImageChunk:
    """An encoded image; `expected_tokens` is how many positions it takes (required to compute `length`)."""

    data: bytes
    format: str  # "png" or "jpeg" (`ImageFormat`); any string travels, so `bios.spec` can name a bad one
    expected_tokens: int | None = None
    type: Literal["image"] = "image"

    @property
    def length(self) -> int:
        if self.expected_tokens is None:
            raise ValueError("ImageChunk expected_tokens needs to be set in order to compute the length")
        return self.expected_tokens


@dataclass(frozen=True)
class ImageAssetPointerChunk:
    """An image file on the coordinator's host: a local path or a `file://` URL."""

    format: str  # "png" or "jpeg", as for ImageChunk
    location: str
    expected_tokens: int | None = None
    type: Literal["image_asset_pointer"] = "image_asset_pointer"

    @property
    def length(self) -> int:
        if self.expected_tokens is None:
            raise ValueError("ImageAssetPointerChunk expected_tokens needs to be set in order to compute the length")
        return self.expected_tokens


ModelInputChunk = Union[EncodedTextChunk, ImageChunk, ImageAssetPointerChunk]
IMAGE_CHUNKS = (ImageChunk, ImageAssetPointerChunk)


@dataclass(frozen=True)
class ModelInput:
    """A sequence of chunks; `to_ints` only for text-only inputs, `length` counts image positions too."""

    chunks: list[ModelInputChunk] = field(default_factory=list)

    @classmethod
    def from_ints(cls, tokens: Sequence[int]) -> ModelInput:
        return cls(chunks=[EncodedTextChunk(tokens=[int(t) for t in tokens])])

    @classmethod
    def empty(cls) -> ModelInput:
        return cls(chunks=[])

    def to_ints(self) -> list[int]:
        images = [i for i, chunk in enumerate(self.chunks) if not isinstance(chunk, EncodedTextChunk)]
        if images:
            raise ValueError(
                f"to_ints only supports a ModelInput of EncodedTextChunks, but chunk(s) {images} are "
                f"{type(self.chunks[images[0]]).__name__}; read .chunks instead"
            )
        return [t for chunk in self.chunks for t in chunk.tokens]

    @property
    def has_images(self) -> bool:
        return any(isinstance(chunk, IMAGE_CHUNKS) for chunk in self.chunks)

    @property
    def length(self) -> int:
        return sum(chunk.length for chunk in self.chunks)

    def append(self, chunk: ModelInputChunk) -> ModelInput:
        return ModelInput(chunks=[*self.chunks, chunk])

    def append_int(self, token: int) -> ModelInput:
        return self.append(EncodedTextChunk(tokens=[int(token)]))
