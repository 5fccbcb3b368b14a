"""The memory planner and `bios models list` count a vision-language model's image encoder.

Weights: the planner's and the listing's parameter counts against Transformers' own models (built on the meta
device, so a 2B-shaped Qwen2-VL costs nothing). Activations: the encoder's working-set bound against the bytes
its tensors really hold at their peak during a forward over image patches.
"""

from __future__ import annotations

import weakref
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForImageTextToText

from bios.models.builtin import builtin_config
from bios.models.catalog import BUILTIN_MODELS
from bios.models.memory_plan import ModelShape, estimate, model_shape
from bios.models.model_shape import stored_parameters
from bios.models.param_count import count_parameters
from bios.models.registry import count_parameters as meta_count

TINY_VLM = "bios/tiny-qwen2-vl"
# Qwen2-VL-2B-Instruct's shape (tied embeddings, 1536-wide 28-layer decoder, the 32-block 1280-wide tower).
QWEN2_VL_2B = dict(
    model_type="qwen2_vl",
    tie_word_embeddings=True,
    text_config=dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                     num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768),
    vision_config=dict(depth=32, embed_dim=1280, hidden_size=1536, num_heads=16, mlp_ratio=4, patch_size=14,
                       spatial_merge_size=2, temporal_patch_size=2),
)


def _config_dict(config) -> dict:
    fields = config.to_dict()
    return {**fields, "text_config": config.text_config.to_dict(), "vision_config": config.vision_config.to_dict()}


def _vision_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.model.visual.parameters())


def _tiny_config():
    return builtin_config(BUILTIN_MODELS[TINY_VLM])


def _big_config():
    fields = {key: value for key, value in QWEN2_VL_2B.items() if key != "model_type"}
    return AutoConfig.for_model("qwen2_vl", **fields)


def _qwen2_5_vl_config():
    return AutoConfig.for_model(
        "qwen2_5_vl",
        text_config=dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2),
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=128,
                           fullatt_block_indexes=[1]),
    )


@pytest.mark.parametrize("make_config", [_tiny_config, _big_config, _qwen2_5_vl_config],
                         ids=["tiny", "2B-shaped", "qwen2.5-vl"])
def test_weights_include_the_vision_tower(make_config):
    config = make_config()
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    real = sum(p.numel() for p in model.parameters())
    tower = _vision_parameters(model)
    shape = ModelShape.from_config(config)
    assert shape.vision is not None and shape.vision.parameters == tower
    assert ModelShape.from_dict(_config_dict(config)).vision == shape.vision
    weights = estimate(shape, lora_rank=8, batch_tokens=64).weights // 4
    decoder = estimate(replace(shape, vision=None), lora_rank=8, batch_tokens=64).weights // 4
    assert weights - decoder == tower
    # The decoder's arithmetic is Llama's (no q/k/v biases, q/k norms counted): within 0.1% of the real count,
    # which the decoder alone misses by the whole tower.
    assert abs(weights - real) <= 1e-3 * real < real - decoder
    # The listing counts from config.json alone, exactly (biases included).
    assert count_parameters(_config_dict(config)) == real == meta_count(config)


def test_the_builtin_vlm_is_planned_and_listed_with_its_vision_tower():
    shape = model_shape(TINY_VLM)
    config = _tiny_config()
    with torch.device("meta"):
        tower = _vision_parameters(AutoModelForImageTextToText.from_config(config))
    assert shape.vision is not None and shape.vision.parameters == tower
    assert shape.tensor_parallel_problem(2) and "vision-language" in shape.tensor_parallel_problem(2)
    spec = BUILTIN_MODELS[TINY_VLM]
    assert count_parameters({"model_type": spec.model_type, **spec.config}) == meta_count(config)


def test_a_vlm_directory_is_planned_from_its_weight_files(tmp_path):
    config = _tiny_config()
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.save_pretrained(tmp_path)
    shape = model_shape(str(tmp_path))
    real = sum(p.numel() for p in model.parameters())
    assert shape.stored_parameters == stored_parameters(tmp_path) == real
    assert estimate(shape, lora_rank=8, batch_tokens=64).weights == 4 * real


def test_unknown_vision_families_are_not_guessed_from_the_config():
    shape = ModelShape.from_dict({**QWEN2_VL_2B, "model_type": "some_vlm"})
    assert shape.vision is not None and shape.vision.parameters is None
    with pytest.raises(ValueError, match="model directory"):
        estimate(shape, lora_rank=8, batch_tokens=64)


class _LiveBytes(TorchDispatchMode):
    """The peak bytes of the tensors ops create that are alive at once (inputs, weights and views not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {arg.untyped_storage().data_ptr() for arg in (*args, *(kwargs or {}).values())
                  if isinstance(arg, torch.Tensor)}
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if key in self._seen or key in inputs or storage.nbytes() == 0:  # views of what exists
                    continue
                self._seen.add(key)
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, key, storage.nbytes())
        return out

    def _free(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live -= size


def test_the_vision_activation_bound_covers_a_real_forward():
    config = _tiny_config()
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval().requires_grad_(False)
    tower = ModelShape.from_config(config).vision
    images, side = 8, 8  # 8 images of 8x8 patches (32x32 pixels): 16 image tokens each
    grid = torch.tensor([[1, side, side]] * images)
    pixels = torch.randn(images * side * side, tower.pixels_per_patch)
    tokens = images * side * side // tower.patches_per_token
    with _LiveBytes() as measured:
        model.model.visual(pixels, grid_thw=grid)
    bound = tower.activation_bytes(tokens, 4)
    assert measured.peak <= bound <= 4 * measured.peak, (measured.peak, bound)
