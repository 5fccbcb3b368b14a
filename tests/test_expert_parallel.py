"""Expert parallelism on CPU with gloo: a tiny MoE model split over two workers (each holding half of every
layer's routed experts and their adapters, attention split as tensor parallelism splits it) equals one
unsplit worker: initial adapter, logits, loss, gradients, three optimizer steps, greedy and seeded samples.
Loading a shard reads only its experts, from 3D expert tensors or from one matrix per expert.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from arch_models import build_model, write_model
from test_tensor_parallel import (
    _train,
    assert_close,
    assert_states_close,
    grad_state,
    logprobs_of,
    run_workers,
    train_one_worker,
)

from bios.types import Datum, LoraConfig, ModelInput, SamplingParams
from bios.worker.adapter import AdapterState
from bios.worker.engine import ForwardItem, discard_gradients, forward_backward
from bios.worker.lora import active_adapters, attach_lora
from bios.worker.sampling import SampleItem, generate
from bios.worker.sharded_adapter import (
    create_sharded_adapter,
    gather_adapter_state,
    gather_full_adapter,
    reduce_shared_grads,
    shard_adapter_state,
)
from bios.worker.tensor_parallel import ShardInfo, load_sharded_model, shard_model

ARCHS = ("qwen3_moe", "mixtral")
LORA = LoraConfig(rank=4, seed=11)
TEXTS = (b"experts split over workers", b"route every token", b"and sum what they say", b"ok")
PROMPT = list(b"experts")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, seed=1234)


def moe_model(arch: str):
    model = build_model(arch)
    attach_lora(model)
    return model


def batch() -> list[Datum]:
    return [Datum(ModelInput.from_ints(list(text[:-1])), {"target_tokens": list(text[1:]),
                                                            "weights": [1.0] * (len(text) - 1)}) for text in TEXTS]


def start_state(model) -> dict[str, torch.Tensor]:
    """The full adapter every run starts from: LORA's initial weights with B made non-zero too."""
    state = AdapterState.create("start", model, LORA, device="cpu").state_dict()
    generator = torch.Generator().manual_seed(99)
    return {key: value + 0.05 * torch.randn(value.shape, generator=generator) for key, value in state.items()}


def logits_of(model, adapter: AdapterState) -> torch.Tensor:
    rows = [list(text) for text in TEXTS]
    input_ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.int64)
    mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    with torch.no_grad(), active_adapters(model, [(0, len(rows), adapter)]):
        return model(input_ids=input_ids, attention_mask=mask).logits


def samples(model, adapter: AdapterState) -> list[list[int]]:
    items = [SampleItem(adapter, PROMPT, 2, GREEDY), SampleItem(adapter, PROMPT, 2, SEEDED)]
    return [seq.tokens for response in generate(model, None, items, eos_token_id=None) for seq in response.sequences]


def mixed_batch_equals_alone(model, first: AdapterState, second: AdapterState) -> bool:
    """Two adapters' rows in one batch (each routed to its own experts' LoRA) give what each gives alone."""
    def logprobs(items: list[tuple[AdapterState, list[Datum]]]) -> list[list[torch.Tensor]]:
        outputs = forward_backward(model, [ForwardItem(adapter, data, "cross_entropy", forward_only=True)
                                           for adapter, data in items])
        return [logprobs_of(output) for output in outputs]

    halves = [(first, batch()[0::2]), (second, batch()[1::2])]
    together = logprobs(halves)
    alone = [logprobs([half])[0] for half in halves]
    return all(torch.allclose(a, b, rtol=0, atol=1e-5) for pair in zip(together, alone, strict=True)
               for a, b in zip(*pair, strict=True))


def ep2_work(rank: int, world: int, arch: str, directory) -> dict[str, Any]:
    model = moe_model(arch)
    start = start_state(model)
    info = shard_model(model, rank, world)
    adapter = create_sharded_adapter("a", model, LORA, seed=LORA.seed, device="cpu")
    result: dict[str, Any] = {"initial": gather_full_adapter(adapter, info).state_dict()}
    adapter.load_state_dict(shard_adapter_state(start, info))
    result["logits"] = logits_of(model, adapter)
    [output] = forward_backward(model, [ForwardItem(adapter, batch(), "cross_entropy")])
    reduce_shared_grads(adapter, info)
    result.update(loss=output.metrics["loss:sum"], logprobs=logprobs_of(output), grads=grad_state(adapter))
    discard_gradients(adapter)
    result["mixed"] = mixed_batch_equals_alone(model, adapter, create_sharded_adapter("b", model, LORA, seed=7,
                                                                                       device="cpu"))
    result["train"] = _train(model, adapter, info, batch(), None, None)
    result.update(final=gather_full_adapter(adapter, info).state_dict(), samples=samples(model, adapter))
    expected = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    result["loads"] = {}
    for layout in ("experts-3d", "per-expert"):
        loaded, loaded_info = load_sharded_model(directory / layout, rank, world)
        actual = {**dict(loaded.named_parameters()), **dict(loaded.named_buffers())}
        result["loads"][layout] = loaded_info == info and actual.keys() == expected.keys() and all(
            torch.equal(actual[key], value) for key, value in expected.items()
        )
    return result


@pytest.fixture(scope="module", params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def reference(arch) -> dict[str, Any]:
    model = moe_model(arch)
    adapter = AdapterState.create("a", model, LORA, device="cpu")
    result: dict[str, Any] = {"initial": adapter.state_dict()}
    adapter.load_state_dict(start_state(model))
    result["logits"] = logits_of(model, adapter)
    [output] = forward_backward(model, [ForwardItem(adapter, batch(), "cross_entropy")])
    result.update(loss=output.metrics["loss:sum"], logprobs=logprobs_of(output), grads=grad_state(adapter))
    discard_gradients(adapter)
    result.update(train=train_one_worker(model, adapter, batch()), final=adapter.state_dict(),
                  samples=samples(model, adapter))
    return result


@pytest.fixture(scope="module")
def ep2(arch, tmp_path_factory) -> tuple[ShardInfo, list[dict[str, Any]]]:
    directory = tmp_path_factory.mktemp(f"ep2-{arch}")
    write_model(arch, directory / "experts-3d")  # the parameters as the model holds them: 3D expert tensors
    build_model(arch).save_pretrained(directory / "per-expert")  # transformers' on-disk layout: one per expert
    layout = shard_model(moe_model(arch), 0, 2)
    return layout, run_workers(2, functools.partial(ep2_work, arch=arch, directory=directory), directory)


def test_each_worker_holds_half_of_every_layers_experts(arch):
    whole = moe_model(arch)
    shards = [moe_model(arch) for _ in range(2)]
    infos = [shard_model(model, rank, 2) for rank, model in enumerate(shards)]
    experts = "model.layers.1.mlp.experts"
    for name in ("gate_up_proj", "down_proj"):
        parts = [getattr(model.get_submodule(experts), name) for model in shards]
        assert parts[0].shape[0] == 2
        assert torch.equal(torch.cat(parts), getattr(whole.get_submodule(experts), name)), name
    assert infos[1].kinds[f"{experts}.down_proj"] == "experts"
    assert infos[1].full_target(f"{experts}.down_proj").num_experts == 4
    state = start_state(whole)
    pieces = [shard_adapter_state(state, info) for info in infos]
    key = f"base_model.model.{experts}.lora_A.weight"  # PEFT names down_proj, the outer wrapper, by its module
    assert pieces[0][key].shape[0] == state[key].shape[0] // 2
    assert_states_close(gather_adapter_state(pieces, infos[0]), state, "round trip")


def test_ep2_starts_computes_and_trains_as_one_worker(ep2, reference):
    layout, shards = ep2
    for shard in shards:
        assert_states_close(shard["initial"], reference["initial"], "initial adapter")
        assert_close(shard["logits"], reference["logits"], "logits")
        assert shard["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        for got, want in zip(shard["logprobs"], reference["logprobs"], strict=True):
            assert_close(got, want, "logprobs")
        assert shard["train"]["losses"] == pytest.approx(reference["train"]["losses"], rel=1e-5)
        assert shard["train"]["norms"] == pytest.approx(reference["train"]["norms"], rel=1e-5)
        assert_states_close(shard["final"], reference["final"], "trained adapter")
        assert shard["samples"] == reference["samples"]
        assert shard["mixed"], "two adapters in one batch differ from each alone"
    assert_states_close(gather_adapter_state([shard["grads"] for shard in shards], layout), reference["grads"],
                        "gradients")


def test_ep2_shards_load_only_their_experts_from_either_layout(ep2):
    _, shards = ep2
    for shard in shards:
        assert shard["loads"] == {"experts-3d": True, "per-expert": True}
