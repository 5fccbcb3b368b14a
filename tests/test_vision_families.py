"""Qwen2.5-VL and Qwen3-VL (dense and MoE) beside Qwen2-VL: forward matches Transformers + PEFT, training
lowers the loss, greedy sampling with an image prompt is deterministic and scores its tokens as the training
forward does, and the token-count rule matches each family's image processor. Tiny random models written here."""

from __future__ import annotations

import io
from pathlib import Path

import peft
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from bios import spec
from bios import types as t
from bios.exceptions import BadRequestError
from bios.export import write_peft_adapter
from bios.models import load_base_model
from bios.worker.adapter import AdapterState
from bios.worker.checkpoint import export_state
from bios.worker.engine import ForwardItem, forward_backward
from bios.worker.lora import attach_lora
from bios.worker.vision import image_reader
from vlm_models import CONFIGS, write_vlm

FAMILIES = sorted(CONFIGS)
IMAGE_TOKENS = 4  # a 16x16 image: 4x4 patches of 4 pixels, merged 2x2


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlms")
    return {family: write_vlm(family, root / family) for family in FAMILIES}


def png(rgb: tuple[int, int, int], size: int = 16) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), rgb).save(buffer, format="PNG")
    return buffer.getvalue()


def prompt(tokenizer, rgb, text: bytes = b"") -> t.ModelInput:
    start, end = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    return t.ModelInput(chunks=[t.EncodedTextChunk([65, start]), t.ImageChunk(png(rgb), "png", IMAGE_TOKENS),
                                t.EncodedTextChunk([end, *text])])


def caption_datum(tokenizer, rgb, caption: bytes, eos: int) -> t.Datum:
    """Predict the caption and EOS after the image; the prefix and the image carry weight 0."""
    before = 2 + IMAGE_TOKENS
    targets = [0] * before + list(caption) + [eos]
    return t.Datum(prompt(tokenizer, rgb, caption),
                   {"target_tokens": targets, "weights": [0.0] * before + [1.0] * (len(caption) + 1)})


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_equals_transformers_with_peft(family, model_dirs, tmp_path):
    """Per-token log-probs with an image under a random adapter equal Transformers + PEFT loading its export
    (fp32, 1e-5); the image and the adapter both change them, so the match means something."""
    loaded = load_base_model(str(model_dirs[family]))
    assert loaded.info.vision is not None and loaded.info.vision.model_type == family
    attach_lora(loaded.model)
    adapter = AdapterState.create("run", loaded.model, t.LoraConfig(rank=4, seed=3), device="cpu")
    generator = torch.Generator().manual_seed(0)
    adapter.load_state_dict({k: v + 0.05 * torch.randn(v.shape, generator=generator)
                             for k, v in adapter.state_dict().items()})
    reader = image_reader(loaded.info, loaded.image_processor)

    def logprobs(datum: t.Datum, state: AdapterState = adapter) -> torch.Tensor:
        item = ForwardItem(state, [datum], "cross_entropy", forward_only=True)
        return forward_backward(loaded.model, [item], images=reader)[0].loss_fn_outputs[0]["logprobs"].to_torch()

    datum = caption_datum(loaded.tokenizer, (10, 200, 30), b"caption", loaded.info.eos_token_id)
    bios_logprobs = logprobs(datum)
    state = export_state(adapter, base_model=family, base_info=loaded.info, with_optimizer=False)
    out = write_peft_adapter(state, tmp_path / "adapter", base_model_dir=loaded.info.local_dir)
    base = AutoModelForImageTextToText.from_pretrained(loaded.info.local_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, out).eval()
    pixels = loaded.image_processor(images=[Image.new("RGB", (16, 16), (10, 200, 30))], return_tensors="pt")
    ids = reader.expand(datum.model_input, "datum").tokens[None]
    image = ids[0] == loaded.info.vision.image_token_id
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                       mm_token_type_ids=image[None].int()).logits[0]
    targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].to_numpy())
    reference = torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None]).squeeze(-1)
    assert int(image.sum()) == IMAGE_TOKENS and (bios_logprobs[image] == 0).all()
    torch.testing.assert_close(bios_logprobs[~image], reference[~image], rtol=0, atol=1e-5)

    other_image = logprobs(caption_datum(loaded.tokenizer, (200, 10, 30), b"caption", loaded.info.eos_token_id))
    assert (other_image - bios_logprobs).abs().max() > 1e-3
    plain = AdapterState.create("plain", loaded.model, t.LoraConfig(rank=4, seed=3), device="cpu")
    assert (logprobs(datum, plain) - bios_logprobs).abs().max() > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_training_and_sampling_with_an_image(family, model_dirs, service):
    """Training on a captioned image lowers its loss; greedy sampling with the image prompt is deterministic,
    returns the caption learned, and its token log-probs equal the training forward's on the same sequence."""
    name = str(model_dirs[family])
    loaded = load_base_model(name)
    tokenizer, eos = loaded.tokenizer, loaded.info.eos_token_id
    caption = b"hi!"
    datum = caption_datum(tokenizer, (255, 0, 0), caption, eos)
    tc = service.create_lora_training_client(name, rank=8, seed=0)
    losses = []
    for _ in range(25):
        losses.append(tc.forward_backward([datum], "cross_entropy").result(120).metrics["loss:sum"])
        tc.optim_step(t.AdamParams(learning_rate=1e-2)).result(120)
    assert losses[-1] < 0.1 * losses[0]

    sampler = tc.save_weights_and_get_sampling_client("caption")
    params = t.SamplingParams(max_tokens=len(caption) + 1, temperature=0)
    first, second = (sampler.sample(prompt(tokenizer, (255, 0, 0)), 1, params).result(120).sequences[0]
                     for _ in range(2))
    assert first.tokens == second.tokens == [*caption, eos]
    sampled = prompt(tokenizer, (255, 0, 0), caption)
    before = 2 + IMAGE_TOKENS
    scored = t.Datum(sampled, {"target_tokens": [0] * before + list(caption) + [eos],
                               "weights": [0.0] * before + [1.0] * (len(caption) + 1)})
    forward = tc.forward([scored], "cross_entropy").result(120).loss_fn_outputs[0]["logprobs"].to_torch()
    torch.testing.assert_close(torch.tensor(first.logprobs), forward[before:], rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_token_count_rule_matches_each_familys_processor(family, model_dirs):
    loaded = load_base_model(str(model_dirs[family]))
    limits = spec.Limits(family, loaded.info.vocab_size, loaded.info.max_context_length, loaded.info.vision)
    merge = loaded.image_processor.merge_size
    for width, height in [(16, 16), (7, 30), (64, 64), (100, 20), (33, 17)]:
        buffer = io.BytesIO()
        Image.new("RGB", (width, height), (5, 5, 5)).save(buffer, format="PNG")
        grid = loaded.image_processor(images=[Image.new("RGB", (width, height))], return_tensors="pt")["image_grid_thw"]
        count = int(grid.prod()) // merge**2
        with pytest.raises(BadRequestError, match=f"makes {count} tokens"):
            spec.check_model_input(t.ModelInput(chunks=[t.ImageChunk(buffer.getvalue(), "png", count + 1)]), "x",
                                   limits)
        assert spec.check_model_input(t.ModelInput(chunks=[t.ImageChunk(buffer.getvalue(), "png", count)]), "x",
                                      limits) == count
