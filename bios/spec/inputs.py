"""What every request is checked against: a base model's limits and the model input it reads.

`ModelLimits` is what the rules need of a base model; `check_model_input` checks token and image chunks against
it. The value checks every rule builds on (integers, finite numbers, seeds) live here too, so the training and
sampling rules share one definition of each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from bios import images
from bios import types as t
from bios.exceptions import BadRequestError

MAX_SEED = 2**63 - 1  # seeds travel as int64 (LoRA init, sampling generators)


class ModelLimits(Protocol):
    """What the rules need of a base model; `BaseModelInfo` and `Limits` both have it."""

    name: str
    vocab_size: int
    max_context_length: int
    vision: images.VisionConfig | None


@dataclass(frozen=True)
class Limits:
    name: str
    vocab_size: int
    max_context_length: int
    vision: images.VisionConfig | None = None


def is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) \
        and math.isfinite(value)


def check_seed(seed: object, field_name: str, what: str) -> None:
    if seed is not None and (not is_int(seed) or not 0 <= seed <= MAX_SEED):
        raise BadRequestError(f"{what} must be an integer between 0 and {MAX_SEED} (or None), got {seed!r}",
                              field=field_name)


def check_model_input(model_input: t.ModelInput, where: str, limits: ModelLimits | None) -> int:
    """A model input of token and image chunks; returns its length (image chunks count their tokens).

    Every image must decode as its declared format and say how many tokens it becomes (`expected_tokens`),
    which must be what the model's image processor makes of it; images need a vision-language model.
    """
    tokens: list[int] = []
    n = 0
    for i, chunk in enumerate(model_input.chunks):
        if isinstance(chunk, t.EncodedTextChunk):
            tokens.extend(chunk.tokens)
            n += len(chunk.tokens)
        else:
            n += _check_image(chunk, f"{where}.chunks[{i}]", limits)
    check_tokens(tokens, where, limits, length=n)
    return n


def _check_image(chunk: object, where: str, limits: ModelLimits | None) -> int:
    """One image chunk (already read from disk if it was a pointer); returns its token count."""
    if not isinstance(chunk, t.ImageChunk):
        raise BadRequestError(f"{where} is a {type(chunk).__name__}; Bios reads image pointers into image chunks "
                              "when it accepts a request, so only token and image chunks reach this check", field=where)
    if limits is not None and limits.vision is None:
        raise BadRequestError(f"{where} is an image, but {limits.name} is a text-only model: send images to a "
                              "vision-language model", field=where)
    try:
        image = images.decode_image(chunk)
    except images.ImageError as exc:
        raise BadRequestError(f"{where}: {exc}", field=where) from None
    count = None if limits is None else images.image_token_count(limits.vision, image.width, image.height)
    expected = chunk.expected_tokens
    if not is_int(expected) or expected < 1:
        hint = f" (this {image.width}x{image.height} image is {count} tokens for {limits.name})" if count else ""
        raise BadRequestError(f"{where}.expected_tokens must be set to the image's token count{hint}, got "
                              f"{expected!r}", field=f"{where}.expected_tokens")
    if count is not None and count != expected:
        raise BadRequestError(f"{where}.expected_tokens is {expected}, but {limits.name}'s image processor makes "
                              f"{count} tokens of this {image.width}x{image.height} image", field=f"{where}.expected_tokens")
    return expected


def check_tokens(tokens: list[int], where: str, limits: ModelLimits | None, *, length: int | None = None) -> int:
    """Token ids of a prompt or input: non-empty, in the vocabulary, within the context (`length` with images)."""
    n = len(tokens) if length is None else length
    if n == 0:
        raise BadRequestError(f"{where} is empty", field=where)
    bad = next((tok for tok in tokens if not is_int(tok) or tok < 0
                or (limits is not None and tok >= limits.vocab_size)), None)
    if bad is not None:
        vocab = f"{limits.name}'s vocabulary [0, {limits.vocab_size})" if limits is not None else "[0, vocab)"
        raise BadRequestError(f"{where} has token id {bad!r}, outside {vocab}", field=where)
    if limits is not None and n > limits.max_context_length:
        raise BadRequestError(f"{where} has {n} tokens, more than {limits.name}'s context of "
                              f"{limits.max_context_length}", field=where)
    return n
