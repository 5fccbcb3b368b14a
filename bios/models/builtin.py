"""The built-in tiny models: random weights from a fixed seed plus a byte-level tokenizer.

They exist so tests and `bios demo --quick` run in seconds with nothing downloaded. Each is written once into
the cache as an ordinary Hugging Face directory and then loaded through `from_pretrained` like any other model,
so the code paths under test are the real ones.

Weights are drawn from numpy's PCG64 bit stream (stable across numpy versions and machines) and turned into
floats with exact integer arithmetic plus one IEEE multiply, so every machine writes byte-identical weights;
`torch.normal_` would not guarantee that (its vectorised kernels differ between CPUs).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    PreTrainedConfig,
    PreTrainedTokenizerFast,
)

from bios.models.cache import is_model_dir, model_dir_for, save_model_files, staged_model_dir
from bios.models.catalog import (
    BOS,
    BUILTIN_CONTEXT,
    BUILTIN_MODELS,
    BYTE_VOCAB_SIZE,
    EOS,
    PAD,
    ROLE_TOKENS,
    SPECIAL_TOKENS,
    BuiltinModel,
)

INIT_STD = 0.02

# Every turn ends with EOS, so a model fine-tuned on chats stops by itself when sampling stops at EOS.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def builtin_config(spec: BuiltinModel) -> PreTrainedConfig:
    return AutoConfig.for_model(spec.model_type, dtype="float32", **spec.config)


def ensure_builtin(name: str) -> Path:
    """Write the built-in model `name` into the cache unless it is there; return its directory."""
    spec = BUILTIN_MODELS[name]
    final = model_dir_for(name)
    if is_model_dir(final):
        return final
    with staged_model_dir(final) as stage:
        write_builtin(spec, stage)
    return final


def write_builtin(spec: BuiltinModel, directory: Path) -> None:
    vision = spec.processor is not None
    model_class = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    model = model_class.from_config(builtin_config(spec), dtype=torch.float32)
    _fill_deterministically(model, spec.seed)
    save_model_files(model, directory)
    byte_level_tokenizer(spec.extra_tokens).save_pretrained(directory)
    if vision:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        Qwen2VLImageProcessorPil(**spec.processor).save_pretrained(directory)


def _fill_deterministically(model: torch.nn.Module, seed: int) -> None:
    """Uniform(-a, a) weights with std INIT_STD, norm weights 1, biases 0, in parameter-name order."""
    bits = np.random.PCG64(seed)
    bound = np.float32(INIT_STD * math.sqrt(3.0))
    norm_weights = {f"{name}.weight" for name, module in model.named_modules() if "Norm" in type(module).__name__}
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.ndim == 1:
                param.fill_(1.0 if name in norm_weights else 0.0)
                continue
            top24 = (bits.random_raw(param.numel()) >> np.uint64(40)).astype(np.float32)
            unit = (top24 - np.float32(2**23)) * np.float32(2.0**-23)  # exact: in [-1, 1)
            param.copy_(torch.from_numpy(unit * bound).reshape(param.shape))


def byte_level_tokenizer(extra_tokens: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """Token id b < 256 is byte b; the special tokens, then `extra_tokens`, follow. Any UTF-8 text round-trips."""
    byte_to_char = _gpt2_byte_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(BYTE_VOCAB_SIZE)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in (*SPECIAL_TOKENS, *extra_tokens)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[*ROLE_TOKENS, *extra_tokens],
        chat_template=CHAT_TEMPLATE,
        model_max_length=BUILTIN_CONTEXT,
    )


def _gpt2_byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, which the ByteLevel pre-tokenizer and decoder expect."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(BYTE_VOCAB_SIZE):
        if b not in mapping:
            mapping[b] = chr(BYTE_VOCAB_SIZE + shifted)
            shifted += 1
    return mapping
