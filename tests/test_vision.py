"""Images in, text out: the tiny vision-language model learns a caption per image, matches Transformers + PEFT,
and bad images are refused at acceptance."""

from __future__ import annotations

import io

import numpy as np
import peft
import pytest
import tinker
from tinker import types as tt
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

import bios
from bios import spec
from bios import types as t
from bios.exceptions import BadRequestError
from bios.export import write_peft_adapter
from bios.models import load_base_model
from bios.transport.codec import Envelope
from bios.worker.adapter import AdapterState
from bios.worker.checkpoint import export_state
from bios.worker.engine import ForwardItem, forward_backward
from bios.worker.lora import attach_lora
from bios.worker.vision import image_reader
from bios.wire import make_codec

VLM = "bios/tiny-qwen2-vl"
IMAGE_TOKENS = 4  # a 16x16 image: 4x4 patches of 4 pixels, merged 2x2
CAPTIONS = {(255, 0, 0): "a red square", (0, 160, 0): "green grass", (0, 0, 255): "deep blue sea",
            (255, 220, 0): "yellow sun"}


def png(rgb: tuple[int, int, int], size: int = 16, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), rgb).save(buffer, format=fmt)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def vlm():
    return load_base_model(VLM)


@pytest.fixture(scope="module")
def vision_tokens(vlm):
    return vlm.tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])


def image_prompt(vision_tokens, image: t.ImageChunk, text: bytes = b"") -> t.ModelInput:
    start, end = vision_tokens
    return t.ModelInput(chunks=[t.EncodedTextChunk([start]), image, t.EncodedTextChunk([end, *text])])


def caption_datum(vision_tokens, rgb, caption: str, eos: int) -> t.Datum:
    """Predict the caption (and EOS) after the image; the image and its delimiters carry weight 0."""
    text = list(caption.encode())
    model_input = image_prompt(vision_tokens, t.ImageChunk(png(rgb), "png", IMAGE_TOKENS), bytes(text))
    before = 1 + IMAGE_TOKENS  # <|vision_start|> and the image; <|vision_end|> predicts the caption's first byte
    targets = [0] * before + text + [eos]
    return t.Datum(model_input, {"target_tokens": targets, "weights": [0.0] * before + [1.0] * (len(text) + 1)})


def test_model_input_chunks_length_and_wire():
    image = t.ImageChunk(png((1, 2, 3)), "png", IMAGE_TOKENS)
    model_input = t.ModelInput.from_ints([1, 2]).append(image).append_int(3)
    assert model_input.length == 3 + IMAGE_TOKENS and model_input.has_images
    with pytest.raises(ValueError, match="ImageChunk"):
        model_input.to_ints()
    with pytest.raises(ValueError, match="expected_tokens"):
        _ = t.ImageChunk(b"", "png").length
    codec = make_codec()
    datum = t.Datum(model_input, {"target_tokens": [0] * model_input.length})
    assert codec.decode(codec.encode(Envelope(1, datum))).body.model_input == model_input


def test_captions_are_learned_per_image(service, vlm, vision_tokens):
    """Four solid colours, four captions: greedy sampling returns none of them before training, each after."""
    eos = vlm.info.eos_token_id
    tc = service.create_lora_training_client(VLM, rank=8, seed=0)
    batch = [caption_datum(vision_tokens, rgb, caption, eos) for rgb, caption in CAPTIONS.items()]

    def captions(sampler) -> list[bytes]:
        futures = [sampler.sample(image_prompt(vision_tokens, t.ImageChunk(png(rgb), "png", IMAGE_TOKENS)), 1,
                                  t.SamplingParams(max_tokens=len(caption) + 1, temperature=0))
                   for rgb, caption in CAPTIONS.items()]
        return [bytes(tok for tok in f.result(60).sequences[0].tokens if tok != eos) for f in futures]

    wanted = [caption.encode() for caption in CAPTIONS.values()]
    before = captions(service.create_sampling_client(base_model=VLM))
    assert sum(got == want for got, want in zip(before, wanted)) == 0
    for _ in range(60):
        tc.forward_backward(batch, "cross_entropy")
        tc.optim_step(t.AdamParams(learning_rate=3e-3))
    assert captions(tc.save_weights_and_get_sampling_client("captions")) == wanted
    logprobs = tc.forward(batch[:1], "cross_entropy").result(60).loss_fn_outputs[0]["logprobs"].to_numpy()
    assert (logprobs[1:1 + IMAGE_TOKENS] == 0).all()  # image positions report 0 and weigh nothing


def test_forward_equals_transformers_with_peft(tmp_path, vision_tokens, monkeypatch):
    """Per-token log-probs of a trained-like adapter with an image, against Transformers + PEFT loading the
    exported adapter (fp32, 1e-5)."""
    monkeypatch.setenv("BIOS_BASE_DTYPE", "float32")
    loaded = load_base_model(VLM)
    attach_lora(loaded.model)
    adapter = AdapterState.create("run", loaded.model, t.LoraConfig(rank=4, seed=3), device="cpu")
    assert not any("visual" in target.module_name for target in adapter.targets)
    generator = torch.Generator().manual_seed(0)
    adapter.load_state_dict({k: v + 0.05 * torch.randn(v.shape, generator=generator)
                             for k, v in adapter.state_dict().items()})
    datum = caption_datum(vision_tokens, (10, 200, 30), "caption", loaded.info.eos_token_id)
    reader = image_reader(loaded.info, loaded.image_processor)
    output = forward_backward(loaded.model, [ForwardItem(adapter, [datum], "cross_entropy", forward_only=True)],
                              images=reader)[0]
    bios_logprobs = output.loss_fn_outputs[0]["logprobs"].to_torch()

    state = export_state(adapter, base_model=VLM, base_info=loaded.info, with_optimizer=False)
    out = write_peft_adapter(state, tmp_path / "adapter", base_model_dir=loaded.info.local_dir)
    base = AutoModelForImageTextToText.from_pretrained(loaded.info.local_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, out).eval()
    image = Image.new("RGB", (16, 16), (10, 200, 30))
    pixels = loaded.image_processor(images=[image], return_tensors="pt")
    ids = reader.expand(datum.model_input, "datum").tokens[None]
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                       mm_token_type_ids=(ids == loaded.info.vision.image_token_id).int()).logits[0]
    targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].to_numpy())
    reference = torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None]).squeeze(-1)
    text = torch.ones_like(reference, dtype=torch.bool)
    text[1:1 + IMAGE_TOKENS] = False
    torch.testing.assert_close(bios_logprobs[text], reference[text], rtol=0, atol=1e-5)
    plain = forward_backward(loaded.model, [ForwardItem(
        AdapterState.create("plain", loaded.model, t.LoraConfig(rank=4, seed=3), device="cpu"), [datum],
        "cross_entropy", forward_only=True)], images=reader)[0].loss_fn_outputs[0]["logprobs"].to_torch()
    assert (plain - bios_logprobs).abs().max() > 1e-3  # the adapter matters, so the match above means something


@pytest.mark.parametrize("chunk, message", [
    (t.ImageChunk(png((9, 9, 9)), "png", IMAGE_TOKENS + 1), "expected_tokens is 5, but bios/tiny-qwen2-vl's image "
                                                            "processor makes 4 tokens of this 16x16 image"),
    (t.ImageChunk(png((9, 9, 9))[:40], "png", IMAGE_TOKENS), "corrupt or truncated|not a png image"),
    (t.ImageChunk(b"GIF89a" + bytes(30), "gif", IMAGE_TOKENS), "format 'gif' is not supported"),
    (t.ImageChunk(png((9, 9, 9), fmt="JPEG"), "png", IMAGE_TOKENS), "not a png image"),
    (t.ImageChunk(png((9, 9, 9)), "png"), "expected_tokens must be set .* is 4 tokens"),
    (t.ImageAssetPointerChunk("png", "https://example.com/cat.png", IMAGE_TOKENS), "local paths or file:// URLs"),
])
def test_bad_images_are_refused_at_acceptance_and_the_run_is_untouched(service, vision_tokens, chunk, message):
    tc = service.create_lora_training_client(VLM, rank=4, seed=1)
    good = caption_datum(vision_tokens, (1, 2, 3), "ok", 257)
    before = tc.forward([good], "cross_entropy").result(60).loss_fn_outputs[0]["logprobs"].to_numpy()
    bad = t.Datum(image_prompt(vision_tokens, chunk), {"target_tokens": [0] * 6, "weights": [0.0] * 6})
    with pytest.raises(BadRequestError, match=message):
        tc.forward_backward([good, bad], "cross_entropy").result(60)
    tc.optim_step(t.AdamParams(learning_rate=1e-2)).result(60)  # no gradient from the refused call
    after = tc.forward([good], "cross_entropy").result(60).loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_array_equal(before, after)


def test_an_image_pointer_is_read_from_the_coordinators_disk(service, vision_tokens, tmp_path):
    path = tmp_path / "red.png"
    path.write_bytes(png((255, 0, 0)))
    sampler = service.create_sampling_client(base_model=VLM)
    params = t.SamplingParams(max_tokens=4, temperature=0)
    by_bytes = sampler.sample(image_prompt(vision_tokens, t.ImageChunk(png((255, 0, 0)), "png", 4)), 1, params)
    by_path = sampler.sample(image_prompt(vision_tokens, t.ImageAssetPointerChunk("png", f"file://{path}", 4)), 1,
                             params)
    assert by_path.result(60).sequences[0].tokens == by_bytes.result(60).sequences[0].tokens


def test_an_image_on_a_text_only_model_is_refused(service, vision_tokens):
    sampler = service.create_sampling_client(base_model="bios/tiny-llama")
    prompt = t.ModelInput(chunks=[t.EncodedTextChunk([65]), t.ImageChunk(png((1, 1, 1)), "png", 4)])
    with pytest.raises(BadRequestError, match="text-only model"):
        sampler.sample(prompt, 1, t.SamplingParams(max_tokens=2)).result(60)


def test_the_token_count_rule_needs_no_torch_and_matches_the_processor(vlm):
    """The coordinator's count (`bios.images`) equals what the image processor makes, over sizes and shapes."""
    limits = spec.Limits(VLM, vlm.info.vocab_size, vlm.info.max_context_length, vlm.info.vision)
    for width, height in [(16, 16), (7, 30), (64, 64), (100, 20), (33, 17)]:
        image = t.ImageChunk(_sized_png(width, height), "png", 1)
        grid = vlm.image_processor(images=[Image.new("RGB", (width, height))], return_tensors="pt")["image_grid_thw"]
        count = int(grid.prod()) // 4
        with pytest.raises(BadRequestError, match=f"makes {count} tokens"):
            spec.check_model_input(t.ModelInput(chunks=[t.ImageChunk(image.data, "png", count + 1)]), "x", limits)
        assert spec.check_model_input(t.ModelInput(chunks=[t.ImageChunk(image.data, "png", count)]), "x",
                                      limits) == count


def _sized_png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (5, 5, 5)).save(buffer, format="PNG")
    return buffer.getvalue()


# ------------------------------------------------------------------------------------------ the tinker SDK


@pytest.fixture(scope="module")
def tinker_service(cluster):
    with tinker.ServiceClient(base_url=cluster.http_url, api_key="tml-test") as client:
        yield client


def tinker_prompt(vision_tokens, rgb, text: bytes = b"", expected_tokens: int = IMAGE_TOKENS) -> tt.ModelInput:
    start, end = vision_tokens
    return tt.ModelInput(chunks=[
        tt.EncodedTextChunk(tokens=[start]),
        tt.ImageChunk(data=png(rgb), format="png", expected_tokens=expected_tokens),
        tt.EncodedTextChunk(tokens=[end, *text]),
    ])


def test_captions_through_the_tinker_sdk(tinker_service, vlm, vision_tokens):
    """The same lesson with the official SDK over the gateway: ImageChunk in protobuf (training) and JSON
    (sampling); a wrong expected_tokens is a 400 naming both counts."""
    eos = vlm.info.eos_token_id
    tc = tinker_service.create_lora_training_client(base_model=VLM, rank=8, seed=0).result()
    batch = []
    for rgb, caption in CAPTIONS.items():
        native = caption_datum(vision_tokens, rgb, caption, eos)
        batch.append(tt.Datum(
            model_input=tinker_prompt(vision_tokens, rgb, caption.encode()),
            loss_fn_inputs={key: tt.TensorData.from_numpy(value.to_numpy())
                            for key, value in native.loss_fn_inputs.items()}))
    for _ in range(60):
        tc.forward_backward(batch, "cross_entropy")
        tc.optim_step(tt.AdamParams(learning_rate=3e-3))
    sampler = tc.save_weights_and_get_sampling_client().result()
    for rgb, caption in CAPTIONS.items():
        out = sampler.sample(tinker_prompt(vision_tokens, rgb), 1,
                             tt.SamplingParams(max_tokens=len(caption) + 1, temperature=0)).result()
        assert bytes(tok for tok in out.sequences[0].tokens if tok != eos) == caption.encode()
    wrong = tt.Datum(model_input=tinker_prompt(vision_tokens, (0, 0, 0), b"x", expected_tokens=9),
                         loss_fn_inputs=batch[0].loss_fn_inputs)
    with pytest.raises(tinker.BadRequestError, match="expected_tokens is 9, but .* makes 4 tokens"):
        tc.forward_backward([wrong], "cross_entropy").result()
