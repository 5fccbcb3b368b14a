"""The request spec: what a valid request is, in one place.

The coordinator applies every rule here when it accepts a request, so a user error is a `BadRequestError`
naming the field at the first await and nothing about the run changes. Workers apply the same rules to each
item before batching it with other tenants' items, so an item that slips past admission fails alone. Nothing
here imports torch: the coordinator must not, and the rules are about values, not tensors.

A rule needs to know four things of a base model (`ModelLimits`): its name, vocabulary, context and image
geometry (None for a text-only model). Both `BaseModelInfo` (what a worker reports) and the coordinator's
`Limits` (read from `config.json` and the image processor config) have them.

This module is a facade by design: it defines nothing and only re-exports, so admission and the workers read
every rule through one `from bios import spec`, while each rule lives in the module for its kind of request:
`inputs` (model limits, model inputs, the shared value checks), `training` (losses, data, LoRA, optimizers)
and `sampling` (sampling requests).
"""

from .inputs import MAX_SEED, Limits, ModelLimits, check_model_input, check_seed
from .sampling import (
    DEFAULT_MAX_TOKENS,
    MAX_ADDITIVE_PENALTY,
    MAX_PROMPT_TOPK,
    MAX_SAMPLE_TOPK,
    MAX_SAMPLES_PER_REQUEST,
    MAX_TARGET_PROMPT_IDS,
    check_sample,
    check_target_prompt_logprobs,
    resolved_max_tokens,
    stop_strings,
)
from .training import (
    CUSTOM_LOSS,
    LORA_FLAGS,
    LOSSES,
    MAX_LORA_RANK,
    OPTIMIZERS,
    ConfigKey,
    LossSpec,
    check_adam,
    check_datum,
    check_dimuon,
    check_forward,
    check_lora,
    check_optim_params,
    check_optimizer,
    loss_config,
    loss_spec,
    splits_rows,
)

__all__ = [
    # .inputs
    "MAX_SEED", "Limits", "ModelLimits", "check_model_input", "check_seed",
    # .sampling
    "DEFAULT_MAX_TOKENS", "MAX_ADDITIVE_PENALTY", "MAX_PROMPT_TOPK", "MAX_SAMPLE_TOPK", "MAX_SAMPLES_PER_REQUEST",
    "MAX_TARGET_PROMPT_IDS", "check_sample", "check_target_prompt_logprobs", "resolved_max_tokens", "stop_strings",
    # .training
    "CUSTOM_LOSS", "LORA_FLAGS", "LOSSES", "MAX_LORA_RANK", "OPTIMIZERS", "ConfigKey", "LossSpec", "check_adam",
    "check_datum", "check_dimuon", "check_forward", "check_lora", "check_optim_params", "check_optimizer",
    "loss_config", "loss_spec", "splits_rows",
]
