"""Tiny random models of the architectures people fine-tune, written from a config with the built-in byte
tokenizer, for tests of LoRA targets, training, export and memory plans."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bios.models.builtin import byte_level_tokenizer
from bios.models.cache import save_model_files
from bios.models.catalog import BOS, BUILTIN_VOCAB_SIZE, BYTE_VOCAB_SIZE, EOS, PAD, SPECIAL_TOKENS

_COMMON = dict(
    vocab_size=BUILTIN_VOCAB_SIZE,
    bos_token_id=BYTE_VOCAB_SIZE + SPECIAL_TOKENS.index(BOS),
    eos_token_id=BYTE_VOCAB_SIZE + SPECIAL_TOKENS.index(EOS),
    pad_token_id=BYTE_VOCAB_SIZE + SPECIAL_TOKENS.index(PAD),
    tie_word_embeddings=False,
)
_DECODER = dict(
    _COMMON, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128,
)
_MOE = dict(num_experts_per_tok=2)
CONFIGS = {
    "llama": ("llama", dict(_DECODER)),
    "phi3": ("phi3", dict(_DECODER)),
    "gpt2": ("gpt2", dict(_COMMON, n_embd=32, n_layer=2, n_head=4, n_positions=128)),
    "qwen3_moe": ("qwen3_moe", dict(_DECODER, **_MOE, head_dim=8, moe_intermediate_size=16, num_experts=4)),
    "mixtral": ("mixtral", dict(_DECODER, **_MOE, num_local_experts=4)),
    "gpt_oss": ("gpt_oss", dict(_DECODER, **_MOE, head_dim=8, num_local_experts=4,
                                layer_types=["sliding_attention", "full_attention"])),
    # Falcon-7B's layout: one fused query_key_value with a single k/v head, attention and MLP side by side
    "falcon": ("falcon", dict(_COMMON, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
                              parallel_attn=True, max_position_embeddings=128)),
    "deepseek_v3": ("deepseek_v3", dict(
        _DECODER, **_MOE, moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
        q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_group=1,
        topk_group=1, rope_scaling=None, num_key_value_heads=4,  # MLA has as many k/v heads as queries
    )),
}
MOE = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3")


def build_model(arch: str, *, seed: int = 0, std: float = 0.08):
    """The tiny `arch` model in fp32, every weight matrix drawn with `std` (larger than the default init, so
    adapters and routing visibly change the outputs)."""
    model_type, fields = CONFIGS[arch]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields), dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim >= 2:
                param.normal_(0.0, std)
    return model


def write_model(arch: str, directory: Path) -> Path:
    """`build_model(arch)` saved as a Hugging Face directory with the byte tokenizer; returns `directory`."""
    save_model_files(build_model(arch), directory)
    byte_level_tokenizer().save_pretrained(directory)
    return directory
