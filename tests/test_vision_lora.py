"""LoRA on the vision tower (`LoraConfig.train_vision`): off by default (nothing in the tower is adapted); on, the
tower's linear layers are adapted, trained and exported; patches follow their row's adapter in mixed batches; a
VLM adapter's state round-trips; image and text-only prompts sample in one batch as each alone."""

from __future__ import annotations

import io

import peft
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForImageTextToText

from bios import types as t
from bios.exceptions import BadRequestError
from bios.export import write_peft_adapter
from bios.models import load_base_model
from bios.worker.adapter import AdapterState
from bios.worker.checkpoint import export_state
from bios.worker.engine import ForwardItem, commit_gradients, forward_backward, optim_step
from bios.worker.lora import attach_lora
from bios.worker.sampling import SampleItem, generate
from bios.worker.vision import image_reader, in_vision_tower
from vlm_models import write_vlm

VLM = "bios/tiny-qwen2-vl"
FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]  # three tower designs: plain, windowed, deepstack mergers


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each family's model loaded with LoRA attached, and its image reader."""
    root = tmp_path_factory.mktemp("vlms")
    loaded = {}
    for family in FAMILIES:
        name = VLM if family == "qwen2_vl" else str(write_vlm(family, root / family))
        model = load_base_model(name)
        attach_lora(model.model)
        loaded[family] = (model, image_reader(model.info, model.image_processor))
    return loaded


def png(rgb, size: int = 16) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), rgb).save(buffer, format="PNG")
    return buffer.getvalue()


def image_datum(tokenizer, rgb, size: int = 16, text: bytes = b"a cat") -> t.Datum:
    start, end = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    tokens = (size // 8) ** 2  # 4-pixel patches merged 2x2
    model_input = t.ModelInput(chunks=[t.EncodedTextChunk([start]), t.ImageChunk(png(rgb, size), "png", tokens),
                                       t.EncodedTextChunk([end, *text])])
    n = model_input.length
    return t.Datum(model_input, {"target_tokens": [*([0] * (tokens + 1)), *text, 257],
                                 "weights": [0.0] * (tokens + 1) + [1.0] * (n - tokens - 1)})


def text_datum(text: bytes = b"plain text") -> t.Datum:
    return t.Datum(t.ModelInput.from_ints(list(text)), {"target_tokens": [*text[1:], 257],
                                                        "weights": [1.0] * len(text)})


def randomized(model, name: str, config: t.LoraConfig, seed: int) -> AdapterState:
    adapter = AdapterState.create(name, model, config, device="cpu")
    generator = torch.Generator().manual_seed(seed)
    adapter.load_state_dict({k: v + 0.05 * torch.randn(v.shape, generator=generator)
                             for k, v in adapter.state_dict().items()})
    return adapter


def logprobs(model, reader, items: list[ForwardItem]) -> list[torch.Tensor]:
    outputs = forward_backward(model, items, images=reader)
    return [output["logprobs"].to_torch() for result in outputs for output in result.loss_fn_outputs]


@pytest.mark.parametrize("family", FAMILIES)
def test_train_vision_adapts_trains_and_exports_the_tower(family, models, tmp_path):
    loaded, reader = models[family]
    model = loaded.model
    tower_linears = {name for name, module in model.named_modules()
                     if in_vision_tower(name) and isinstance(module, nn.Linear)}
    default = AdapterState.create("text", model, t.LoraConfig(rank=4, seed=1), device="cpu")
    assert tower_linears and not any(in_vision_tower(target.module_name) for target in default.targets)
    adapter = AdapterState.create("vision", model, t.LoraConfig(rank=4, seed=1, train_vision=True), device="cpu")
    tower = [target.module_name for target in adapter.targets if in_vision_tower(target.module_name)]
    assert set(tower) == tower_linears
    assert {target.module_name for target in default.targets} < {target.module_name for target in adapter.targets}

    datum = image_datum(loaded.tokenizer, (200, 30, 10))
    for _ in range(3):
        forward_backward(model, [ForwardItem(adapter, [datum], "cross_entropy")], images=reader)
        commit_gradients(adapter)
        optim_step(adapter, t.AdamParams(learning_rate=1e-2))
    assert all(adapter.lora_pair(name)[1].abs().max() > 0 for name in tower)  # every tower B moved from zero

    ours = logprobs(model, reader, [ForwardItem(adapter, [datum], "cross_entropy", forward_only=True)])[0]
    state = export_state(adapter, base_model=family, base_info=loaded.info, with_optimizer=False)
    out = write_peft_adapter(state, tmp_path / "adapter", base_model_dir=loaded.info.local_dir)
    assert any(".visual." in key for key in load_file(out / "adapter_model.safetensors"))
    peft_model = peft.PeftModel.from_pretrained(
        AutoModelForImageTextToText.from_pretrained(loaded.info.local_dir, dtype=torch.float32), out).eval()
    pixels = loaded.image_processor(images=[Image.new("RGB", (16, 16), (200, 30, 10))], return_tensors="pt")
    ids = reader.expand(datum.model_input, "datum").tokens[None]
    image = ids[0] == loaded.info.vision.image_token_id
    with torch.no_grad():
        logits = peft_model(input_ids=ids, pixel_values=pixels["pixel_values"],
                            image_grid_thw=pixels["image_grid_thw"], mm_token_type_ids=image[None].int()).logits[0]
    targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].to_numpy())
    reference = torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(ours[~image], reference[~image], rtol=0, atol=2e-3)

    with torch.no_grad():  # the tower's adapter matters: without it the text positions read differently
        for name in tower:
            adapter.lora_pair(name)[1].zero_()
    without = logprobs(model, reader, [ForwardItem(adapter, [datum], "cross_entropy", forward_only=True)])[0]
    assert (without - ours).abs().max() > 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_patches_follow_their_rows_adapter_in_a_mixed_batch(family, models):
    """Two tower-training adapters, one that does not, images of two sizes and a text-only row in one call:
    each item's log-probs equal its own call's."""
    loaded, reader = models[family]
    model, tokenizer = loaded.model, loaded.tokenizer
    vision_config = t.LoraConfig(rank=4, seed=1, train_vision=True)
    items = [
        ForwardItem(randomized(model, "a", vision_config, 1), [image_datum(tokenizer, (9, 90, 200), 32),
                                                               text_datum()], "cross_entropy", forward_only=True),
        ForwardItem(randomized(model, "b", t.LoraConfig(rank=4, seed=2), 2), [image_datum(tokenizer, (9, 90, 200))],
                    "cross_entropy", forward_only=True),
        ForwardItem(randomized(model, "c", vision_config, 3), [image_datum(tokenizer, (250, 250, 0))],
                    "cross_entropy", forward_only=True),
    ]
    together = logprobs(model, reader, items)
    alone = [lp for item in items for lp in logprobs(model, reader, [item])]
    for both, single in zip(together, alone, strict=True):
        torch.testing.assert_close(both, single, rtol=0, atol=1e-5)


def test_train_vision_on_a_text_only_model_is_refused():
    loaded = load_base_model("bios/tiny-llama")
    attach_lora(loaded.model)
    with pytest.raises(BadRequestError, match="has none: set train_vision=false"):
        AdapterState.create("x", loaded.model, t.LoraConfig(rank=4, train_vision=True), device="cpu")


@pytest.mark.parametrize("family", FAMILIES)
def test_image_and_text_prompts_sample_in_one_batch_as_alone(family, models):
    """Left-padded prompts of different lengths, with and without an image and an adapter, in one batch."""
    loaded, reader = models[family]
    model = loaded.model
    adapter = randomized(model, "s", t.LoraConfig(rank=4, seed=5, train_vision=True), 5)
    expanded = reader.expand(image_datum(loaded.tokenizer, (30, 60, 90)).model_input, "prompt")
    params = t.SamplingParams(max_tokens=6, temperature=0)
    items = [SampleItem(adapter, expanded.tokens.tolist(), 1, params, images=expanded.images),
             SampleItem(adapter, list(b"a longer text-only prompt"), 1, params),
             SampleItem(None, expanded.tokens.tolist(), 1, params, images=expanded.images)]
    eos = loaded.info.eos_token_id
    together = generate(model, None, items, eos_token_id=eos, images=reader)
    for item, both in zip(items, together, strict=True):
        single = generate(model, None, [item], eos_token_id=eos, images=reader)[0]
        assert both.sequences[0].tokens == single.sequences[0].tokens
        torch.testing.assert_close(torch.tensor(both.sequences[0].logprobs),
                                   torch.tensor(single.sequences[0].logprobs), rtol=0, atol=1e-5)
    assert together[0].sequences[0].tokens != together[2].sequences[0].tokens or \
        together[0].sequences[0].logprobs != together[2].sequences[0].logprobs


def test_a_tower_training_adapter_round_trips_through_save_state(service):
    tokenizer = load_base_model(VLM).tokenizer
    datum = image_datum(tokenizer, (120, 0, 120))
    tc = service.create_lora_training_client(VLM, rank=4, seed=0, train_vision=True)
    for _ in range(2):
        tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(t.AdamParams(learning_rate=1e-2))
    assert any(group.role == "vision" for group in tc.get_info().lora_targets)
    before = tc.forward([datum], "cross_entropy").result(60).loss_fn_outputs[0]["logprobs"].to_numpy()
    path = tc.save_state("tower").result(60).path
    restored = service.create_training_client_from_state(path)
    after = restored.forward([datum], "cross_entropy").result(60).loss_fn_outputs[0]["logprobs"].to_numpy()
    assert (before == after).all()
    plain = service.create_lora_training_client(VLM, rank=4, seed=0)
    assert not any(group.role == "vision" for group in plain.get_info().lora_targets)
