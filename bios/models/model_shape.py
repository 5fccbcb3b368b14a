"""The dimensions of a decoder that its memory depends on, read from its config and weight files without torch.

Config fields differ between architectures (GPT-2's `n_embd`/`n_layer`/`n_head`/`n_inner`, MoE models'
`num_experts` / `num_local_experts` / `n_routed_experts`, DeepSeek's `first_k_dense_replace`), so each dimension
is looked up under every name transformers uses for it. A model directory's safetensors headers give its exact
parameter count whatever the architecture; the planner uses that count when its own arithmetic (exact for
Llama-family layouts) does not know the layout. A vision-language model's image encoder comes from its
`vision_config` (`bios.models.vision_shape`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bios.exceptions import BadRequestError
from bios.models.vision_shape import VisionTower, vision_tower

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# model_type -> why tensor parallelism cannot split its layers (it splits Llama-style q/k/v/o, gate/up/down)
_UNSPLIT_LAYOUTS = {
    "gpt2": "its Conv1D attention and MLP layers have no tensor-parallel split",
    "phi3": "its fused qkv_proj and gate_up_proj layers have no tensor-parallel split",
    "falcon": "its fused query_key_value layers have no tensor-parallel split",
    "gpt_oss": "its attention sinks have no tensor-parallel split",
}
# model types whose decoder layers hold their dense MLP as an `mlp` child, which a long row's pass runs in chunks
# of positions (`bios.worker.memory_plan.chunk_dense_mlps`); the planner counts whole-row MLPs for the others
_CHUNKED_MLP_TYPES = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "phi3", "gpt2", "gemma", "gemma2", "gemma3_text",
    "deepseek_v3", "olmo", "olmo2", "starcoder2", "granite", "smollm3", "gpt_neox", "falcon", "stablelm"})
_VISION_SPLIT_PROBLEM = "vision-language models are not tensor-parallel split (the shards hold no image processor)"
_NAMES = {
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "num_attention_heads": ("num_attention_heads", "n_head"),
    "max_position_embeddings": ("max_position_embeddings", "n_positions"),
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
}


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on: the decoder's dimensions, its routed experts if any, its stored parameters."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # a dense layer's MLP width
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    max_context_length: int | None = None  # max_position_embeddings, so requests can be checked before a load
    num_experts: int = 0  # routed experts per MoE layer (0: a dense model)
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_intermediate_size: int = 0  # the MLP width of a MoE layer's always-on shared experts
    moe_layers: int = 0  # decoder layers with routed experts (the others are dense)
    split_problem: str | None = None  # why tensor parallelism cannot split this layout at all
    stored_parameters: int | None = None  # from the safetensors headers, for layouts the arithmetic does not know
    vision: VisionTower | None = None  # a vision-language model's image encoder (frozen: LoRA is on the decoder)
    chunked_mlp: bool = False  # a long row's pass runs its dense MLPs a chunk of positions at a time

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> ModelShape:
        """From the fields of a `config.json` (a multimodal config's `text_config` is the decoder's)."""
        text = {key: value for key, value in {**config, **config.get("text_config", {})}.items()
                if key != "vision_config"}
        shape = cls.from_config(_Fields(text, tie=config.get("tie_word_embeddings", False)))
        if "vision_config" not in config:
            return shape
        return replace(shape, vision=vision_tower(config.get("model_type", ""), config["vision_config"]),
                       split_problem=_VISION_SPLIT_PROBLEM)

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> ModelShape:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        model_type = getattr(text, "model_type", "unknown")
        field = {key: next((getattr(text, name) for name in names if getattr(text, name, None) is not None), None)
                 for key, names in _NAMES.items()}
        missing = [key for key in ("hidden_size", "num_hidden_layers", "num_attention_heads") if field[key] is None]
        missing += [] if getattr(text, "vocab_size", None) is not None else ["vocab_size"]
        if missing:
            raise BadRequestError(
                f"cannot plan memory for a {model_type} model: its config has no {', '.join(missing)} (nor any "
                "other name transformers uses for them)",
                field="base_model",
            )
        hidden, layers = int(field["hidden_size"]), int(field["num_hidden_layers"])
        heads = int(field["num_attention_heads"])
        intermediate = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden
        experts = int(field["num_experts"] or 0)
        expert_width = int(getattr(text, "moe_intermediate_size", None) or intermediate) if experts else 0
        shared = int(getattr(text, "shared_expert_intermediate_size", None) or 0) or (
            expert_width * int(getattr(text, "n_shared_experts", None) or 0))
        moe_layers = _moe_layer_count(text, layers) if experts else 0
        split_problem = _UNSPLIT_LAYOUTS.get(model_type)
        vision = _vision_of(config)
        if vision is not None:
            split_problem = _VISION_SPLIT_PROBLEM
        elif shared:
            split_problem = ("its shared experts have no tensor-parallel split (expert parallelism splits routed "
                             "experts only)")
        elif getattr(text, "kv_lora_rank", None):
            split_problem = "its multi-head latent attention projections have no tensor-parallel split"
        return cls(
            vocab_size=int(text.vocab_size),
            hidden_size=hidden,
            intermediate_size=int(intermediate),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(text, "head_dim", None) or hidden // heads),
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(text, "attention_bias", False)),
            mlp_bias=bool(getattr(text, "mlp_bias", False)),
            max_context_length=field["max_position_embeddings"],
            num_experts=experts,
            experts_per_token=int(getattr(text, "num_experts_per_tok", None) or 0),
            expert_intermediate_size=expert_width,
            shared_intermediate_size=shared,
            moe_layers=moe_layers,
            split_problem=split_problem,
            vision=vision,
            chunked_mlp=model_type in _CHUNKED_MLP_TYPES,
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linears(self) -> dict[str, tuple[int, int, str]]:
        """Per dense decoder layer: projection name -> (in, out, how tensor parallelism splits it)."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_size, self.kv_size
        return {
            "q_proj": (h, q, "column"),
            "k_proj": (h, kv, "column"),
            "v_proj": (h, kv, "column"),
            "o_proj": (q, h, "row"),
            "gate_proj": (h, i, "column"),
            "up_proj": (h, i, "column"),
            "down_proj": (i, h, "row"),
        }

    def tensor_parallel_problem(self, tp: int) -> str | None:
        """Why this model cannot be split over `tp` workers, or None when it can."""
        if tp > 1 and self.split_problem:
            return self.split_problem
        dense_layers = self.num_layers > self.moe_layers
        for what, count in (
            ("attention heads", self.num_heads),
            ("key/value heads", self.num_kv_heads),
            ("MLP intermediate size", self.intermediate_size if dense_layers else 0),
            ("routed experts per layer", self.num_experts),
        ):
            if count % tp:
                return f"its {count} {what} do not split evenly over {tp} workers"
        return None


def _vision_of(config: Any) -> VisionTower | None:
    """The image encoder of a Transformers config with a `vision_config` (`from_dict` reads a config.json's)."""
    vision = getattr(config, "vision_config", None)
    if vision is None:
        return None
    return vision_tower(config.model_type, vision if isinstance(vision, Mapping) else vision.to_dict())


def _moe_layer_count(text: Any, layers: int) -> int:
    """Layers with routed experts: DeepSeek's first `first_k_dense_replace` are dense, Qwen-MoE's
    `mlp_only_layers` too, and only every `decoder_sparse_step`-th layer has experts."""
    first_dense = int(getattr(text, "first_k_dense_replace", None) or 0)
    dense = set(getattr(text, "mlp_only_layers", None) or ())
    step = int(getattr(text, "decoder_sparse_step", None) or 1)
    return sum(1 for i in range(first_dense, layers) if i not in dense and (i + 1) % step == 0)


def stored_parameters(directory: Path) -> int | None:
    """Parameters in a model directory's safetensors files, from their JSON headers (no tensor is read)."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for file in files:
        with open(file, "rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        total += sum(math.prod(info["shape"]) for name, info in header.items() if name != "__metadata__")
    return total


class _Fields:
    """A `config.json` dict read through attributes, as `ModelShape.from_config` reads a Transformers config."""

    def __init__(self, fields: Mapping[str, Any], *, tie: bool) -> None:
        self._fields = dict(fields)
        self.tie_word_embeddings = tie

    def __getattr__(self, name: str) -> Any:
        try:
            return self._fields[name]
        except KeyError:
            raise AttributeError(name) from None


def model_shape(name: str) -> ModelShape | None:
    """The shape of base model `name` from its `config.json`, without loading anything or writing a model.

    Built-ins come from their catalog entry; other names from the directory they resolve to on this host, with
    the stored parameter count when the layout is one the planner's arithmetic does not know exactly (any MoE).
    None when this host does not have the model (a pulled model not pulled yet, a directory only workers see).
    """
    from bios.models.catalog import BUILTIN_MODELS
    from bios.models.registry import UnknownModelError, _resolve, canonical_name

    name = canonical_name(name)
    if name in BUILTIN_MODELS:
        spec = BUILTIN_MODELS[name]
        return ModelShape.from_dict({"model_type": spec.model_type, **spec.config})
    try:
        directory = _resolve(name, create=False)
    except UnknownModelError:
        return None
    config_file = directory / "config.json"
    if not config_file.is_file():
        return None
    shape = ModelShape.from_dict(json.loads(config_file.read_text()))
    if shape.split_problem is None and not shape.num_experts:
        return shape
    return replace(shape, stored_parameters=stored_parameters(directory))
