"""Tensor parallelism on CPU with gloo: a TP=2 (and TP=2 x DP=2) tiny Llama equals one unsharded worker.

Workers are spawned processes (a few seconds each to import torch) that meet through a FileStore in
tmp_path. Each worker returns its results through a file; the
single-worker reference runs in the test process itself.
"""

from __future__ import annotations

import datetime
import multiprocessing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import random_llama
from transformers import LlamaForCausalLM

from bios.models import load_base_model, resolve_model_dir
from bios.types import AdamParams, Datum, LoraConfig, ModelInput, SamplingParams
from bios.worker.adapter import AdapterState
from bios.worker.adapter_kinds import HeldState, WholeAdapter, whole_on_rank_zero
from bios.worker.attention import use_bios_attention
from bios.worker.collectives import CollectiveGroup
from bios.worker.context_parallel import SequenceShare
from bios.worker.engine import ForwardItem, commit_gradients, discard_gradients, forward_backward, optim_step
from bios.worker.lora import active_adapters, attach_lora
from bios.worker.memory_plan import enable_activation_checkpointing
from bios.worker.sampling import SampleItem, generate
from bios.worker.split_rows import forward_backward_share
from bios.worker.sharded_adapter import (
    commit_sharded_gradients,
    copy_full_into_shard,
    create_sharded_adapter,
    gather_adapter_state,
    gather_full_adapter,
    reduce_shared_grads,
    shard_adapter_state,
    sharded_optim_step,
    shared_seed,
)
from bios.worker.tensor_parallel import load_sharded_model, rebind_group, shard_model, ShardInfo

VOCAB = 300
LORA = LoraConfig(rank=4, seed=11)
# Clipping at 0.5 is active on every step (the gradient norms are ~2-5), so the global norm must be right.
# Adam moves a weight whose gradient sits at the shards' rounding level by up to ~lr either way: at 1e-2 one
# expert weight in 2048 strayed 3e-6 past the 1e-5 bound when the GEMM library changed; 2e-3 keeps a margin.
ADAM = AdamParams(learning_rate=2e-3, beta1=0.85, beta2=0.98, weight_decay=0.05, grad_clip_norm=0.5)
STEPS = 3
LENGTHS = [11, 7, 9, 4]  # ragged: the batch is padded, so attention runs with a mask
PROMPT = [5, 17, 42, 99, 3]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, seed=1234)
WORKER_TIMEOUT_S = 120


@pytest.fixture(scope="module", autouse=True)
def fp32_base():
    """The exact comparisons need fp32 base weights, in this process and in the workers it spawns, whatever the
    caller's BIOS_BASE_DTYPE; the bf16 pass casts its model itself."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BIOS_BASE_DTYPE", "float32")
        yield


def tiny_llama() -> LlamaForCausalLM:
    """4 query heads and 2 key/value heads: TP=2 keeps one GQA group (2 q heads, 1 kv head) per worker."""
    model = random_llama(VOCAB)
    attach_lora(model)
    return model


def batch() -> list[Datum]:
    generator = torch.Generator().manual_seed(5)
    data = []
    for length in LENGTHS:
        tokens = torch.randint(0, VOCAB, (length + 1,), generator=generator)
        weights = torch.rand(length, generator=generator) * (torch.rand(length, generator=generator) > 0.2)
        inputs = {"target_tokens": tokens[1:], "weights": weights}
        data.append(Datum(ModelInput.from_ints(tokens[:-1].tolist()), inputs))
    return data


def start_state(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The full adapter every run starts from: LORA's initial weights with B made non-zero too."""
    adapter = AdapterState.create("start", model, LORA, device="cpu")
    generator = torch.Generator().manual_seed(99)
    state = adapter.state_dict()
    return {key: value + 0.05 * torch.randn(value.shape, generator=generator) for key, value in state.items()}


def grad_state(adapter: AdapterState) -> dict[str, torch.Tensor]:
    """The adapter's pending gradients under its PEFT key names (the layout `state_dict` uses)."""
    grads = [factor.grad.clone() for target in adapter.targets for factor in adapter.lora_pair(target.module_name)]
    return dict(zip(adapter.state_dict(), grads, strict=True))


def logprobs_of(output) -> list[torch.Tensor]:
    return [record["logprobs"].to_torch() for record in output.loss_fn_outputs]


def full_logits(model: LlamaForCausalLM, adapter: AdapterState) -> torch.Tensor:
    rows = [datum.model_input.to_ints() for datum in batch()]
    input_ids = torch.zeros(len(rows), max(LENGTHS), dtype=torch.int64)
    mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    with torch.no_grad(), active_adapters(model, [(0, len(rows), adapter)]):
        return model(input_ids=input_ids, attention_mask=mask).logits


def samples(model: LlamaForCausalLM, adapter: AdapterState) -> list[list[int]]:
    items = [SampleItem(adapter, PROMPT, 2, GREEDY), SampleItem(adapter, PROMPT, 2, SEEDED)]
    return [seq.tokens for response in generate(model, None, items, eos_token_id=None) for seq in response.sequences]


# ---------------------------------------------------------------------------------------------- workers


def run_workers(world: int, work: Callable[[int, int], dict[str, Any]], tmp_path: Path) -> list[dict[str, Any]]:
    """Start `world` workers that join one gloo group and each return `work(rank, world)`.

    Spawned, not forked: by the time this runs the test process has threads (embedded clusters' SDK loops,
    ZeroMQ I/O threads), and a child forked from it can deadlock on a lock one of them held."""
    context = multiprocessing.get_context("spawn")
    store = tmp_path / "store"
    workers = [context.Process(target=_worker_main, args=(rank, world, store, work, tmp_path)) for rank in range(world)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(WORKER_TIMEOUT_S)
    hung = [rank for rank, worker in enumerate(workers) if worker.is_alive()]
    for rank in hung:
        workers[rank].kill()
        workers[rank].join()
    assert not hung, f"workers {hung} did not finish within {WORKER_TIMEOUT_S}s (a collective mismatch hangs)"
    failed = [(rank, worker.exitcode) for rank, worker in enumerate(workers) if worker.exitcode != 0]
    assert not failed, f"workers failed (rank, exit code): {failed}; their tracebacks are in the captured stderr"
    return [torch.load(tmp_path / f"result{rank}.pt", weights_only=False) for rank in range(world)]


def _worker_main(rank: int, world: int, store: Path, work: Callable, out_dir: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(store), world), rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        torch.save(work(rank, world), out_dir / f"result{rank}.pt")
    finally:
        dist.destroy_process_group()


def tp2_work(rank: int, world: int) -> dict[str, Any]:
    model = tiny_llama()
    start = start_state(model)
    info = shard_model(model, rank, world)
    adapter = create_sharded_adapter("a", model, LORA, seed=LORA.seed, device="cpu")
    result: dict[str, Any] = {"initial": adapter.state_dict(), "drawn_seed": shared_seed(LoraConfig(rank=4))}
    adapter.load_state_dict(shard_adapter_state(start, info))
    result["logits"] = full_logits(model, adapter)
    [output] = forward_backward(model, [ForwardItem(adapter, batch(), "cross_entropy")])
    reduce_shared_grads(adapter, info)
    result.update(loss=output.metrics["loss:sum"], logprobs=logprobs_of(output), grads=grad_state(adapter))
    discard_gradients(adapter)
    # Training runs with activation checkpointing: the recomputation repeats the all-reduces in backward.
    enable_activation_checkpointing(model)
    result.update(train=_train(model, adapter, info, batch(), None, None))
    full = gather_full_adapter(adapter, info)
    result.update(final=full.state_dict(), moments=full.optimizer_state(), samples=samples(model, adapter))
    restored = create_sharded_adapter("restored", model, LORA, seed=0, device="cpu")
    copy_full_into_shard(full, restored, info)
    result["restored"] = all(
        torch.equal(getattr(restored, name), getattr(adapter, name)) for name in ("params", "exp_avg", "exp_avg_sq")
    ) and restored.step == adapter.step
    result["bf16"] = bf16_pass(model, adapter, info)
    return result


def bf16_pass(model: LlamaForCausalLM, adapter: AdapterState, info: ShardInfo | None) -> dict[str, Any]:
    """Loss and gradients with the frozen base in bf16 (the planner's bf16 plans); the adapter stays fp32."""
    model.to(torch.bfloat16)
    discard_gradients(adapter)
    [output] = forward_backward(model, [ForwardItem(adapter, batch(), "cross_entropy")])
    if info is not None:
        reduce_shared_grads(adapter, info)
    return {"loss": output.metrics["loss:sum"], "grads": grad_state(adapter)}


def tp2_dp2_work(rank: int, world: int) -> dict[str, Any]:
    """Ranks 0-1 and 2-3 are the two tensor-parallel replicas; 0-2 and 1-3 sum gradients across replicas. First
    one row split by sequence over the two replicas (`split_row`), then training on a batch's halves."""
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, tp_rank = divmod(rank, 2)
    model = tiny_llama()
    start = start_state(model)
    # Split first, bind the group afterwards: what a worker does when a new generation rebuilds its groups.
    info = shard_model(model, tp_rank, 2)
    rebind_group(model, tp_groups[replica])
    split = split_row(model, start, info, rank, world, tp_groups[replica], dp_groups[tp_rank])
    adapter = create_sharded_adapter("a", model, LORA, seed=LORA.seed, device="cpu")
    adapter.load_state_dict(shard_adapter_state(start, info))
    half = batch()[2 * replica : 2 * replica + 2]
    train = _train(model, adapter, info, half, tp_groups[replica], dp_groups[tp_rank])
    full = gather_full_adapter(adapter, info, tp_groups[replica])
    return {"train": train, "final": full.state_dict(), "moments": full.optimizer_state(), "split": split,
            "recut": recut_to_whole(model, adapter, info, rank, world, tp_groups[replica], dp_groups[tp_rank])}


def recut_to_whole(model, adapter: AdapterState, info: ShardInfo, rank: int, world: int, tp_group,
                   dp_group) -> dict[str, Any]:
    """A new generation of the four holds the adapter whole (tp 1), where the last held shards of 2: ranks 0
    and 1 (replica 0's shards 0 and 1) put it together on rank 0 (`whole_on_rank_zero`), and every rank takes
    it (`cut_from_whole`), a summed gradient not yet applied included. One optimizer step then runs each way:
    whole on every rank, and on the shards; the two must agree."""
    [_] = forward_backward(model, [ForwardItem(adapter, batch()[2 * (rank // 2): 2 * (rank // 2) + 2],
                                               "cross_entropy")])
    reduce_shared_grads(adapter, info, tp_group)
    dist.all_reduce(adapter.pending_grad, group=dp_group)
    commit_sharded_gradients(adapter, info, tp_group)
    group = CollectiveGroup.__new__(CollectiveGroup)  # the new generation: all four, no tensor parallelism
    group.generation, group.rank, group.world, group.tp = 2, rank, world, 1
    group.tp_group = group.dp_group = None
    whole = WholeAdapter(AdapterState.create("a", tiny_llama(), LORA, device="cpu"), None, "tiny")
    held = HeldState(adapter, info) if rank < 2 else None  # what `ShardedAdapter.held` keeps
    whole.cut_from_whole(group, whole_on_rank_zero(group, held, 2))
    optim_step(whole.state, ADAM)
    sharded_optim_step(adapter, ADAM, info, tp_group)
    expected = gather_full_adapter(adapter, info, tp_group)
    return {"whole": whole.state.state_dict(), "moments": whole.state.optimizer_state(), "step": whole.state.step,
            "expected": expected.state_dict(), "expected_moments": expected.optimizer_state(),
            "expected_step": expected.step}


def long_row() -> Datum:
    """One row to split by sequence over two replicas: four chunks of 10 positions (`share_chunks`)."""
    generator = torch.Generator().manual_seed(8)
    tokens = torch.randint(0, VOCAB, (41,), generator=generator)
    return Datum(ModelInput.from_ints(tokens[:-1].tolist()),
                 {"target_tokens": tokens[1:], "weights": torch.rand(40, generator=generator)})


def split_row(model, start: dict[str, torch.Tensor], info: ShardInfo, rank: int, world: int, tp_group,
              dp_group) -> dict[str, Any]:
    """`long_row` split by sequence over two replicas that are tensor-parallel pairs: each shard holder gathers
    its key/value head from the other replica's holder of the same shard, as the worker's `CollectiveGroup`
    does (`all_gather_replicas_` over its `dp_group`). This replica's positions, log-probs, loss share, and the
    gradient summed over the replicas."""
    adapter = create_sharded_adapter("split", model, LORA, seed=LORA.seed, device="cpu")
    adapter.load_state_dict(shard_adapter_state(start, info))
    group = CollectiveGroup.__new__(CollectiveGroup)  # its own rebuild makes the groups from a store
    group.generation, group.rank, group.world, group.tp = 1, rank, world, 2
    group.tp_group, group.dp_group = tp_group, dp_group
    assert use_bios_attention(model)
    row = long_row()
    share = SequenceShare(row.model_input.length, group.replicas, group.replica, group)
    logprobs, loss, _ = forward_backward_share(model, ForwardItem(adapter, [row], "cross_entropy"), 0, share)
    reduce_shared_grads(adapter, info, tp_group)
    dist.all_reduce(adapter.pending_grad, group=dp_group)  # the cycle's sum over replicas
    return {"positions": share.positions, "logprobs": logprobs, "loss": loss, "grads": grad_state(adapter)}


def _train(model, adapter: AdapterState, info: ShardInfo, data: list[Datum], tp_group, dp_group) -> dict[str, list]:
    losses, norms = [], []
    for _ in range(STEPS):
        [output] = forward_backward(model, [ForwardItem(adapter, data, "cross_entropy")])
        reduce_shared_grads(adapter, info, tp_group)
        if dp_group is not None:
            dist.all_reduce(adapter.pending_grad, group=dp_group)
        commit_sharded_gradients(adapter, info, tp_group)
        norms.append(sharded_optim_step(adapter, ADAM, info, tp_group).metrics["grad_norm:mean"])
        losses.append(output.metrics["loss:sum"])
    return {"losses": losses, "norms": norms}


# ---------------------------------------------------------------------------------------------- reference


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """The same work on one unsharded worker, with the engine's own commit and optimizer step."""
    model = tiny_llama()
    adapter = AdapterState.create("a", model, LORA, device="cpu")
    result: dict[str, Any] = {"initial": adapter.state_dict()}
    adapter.load_state_dict(start_state(model))
    result["logits"] = full_logits(model, adapter)
    [output] = forward_backward(model, [ForwardItem(adapter, batch(), "cross_entropy")])
    result.update(loss=output.metrics["loss:sum"], logprobs=logprobs_of(output), grads=grad_state(adapter))
    discard_gradients(adapter)
    result.update(train=train_one_worker(model, adapter, batch()), final=adapter.state_dict(),
                  moments=adapter.optimizer_state(), samples=samples(model, adapter))
    result["bf16"] = bf16_pass(model, adapter, None)
    return result


def train_one_worker(model, adapter: AdapterState, data: list[Datum]) -> dict[str, list]:
    """STEPS steps on one unsharded worker, with the engine's own commit and optimizer step."""
    losses, norms = [], []
    for _ in range(STEPS):
        [output] = forward_backward(model, [ForwardItem(adapter, data, "cross_entropy")])
        commit_gradients(adapter)
        norms.append(optim_step(adapter, ADAM).metrics["grad_norm:mean"])
        losses.append(output.metrics["loss:sum"])
    return {"losses": losses, "norms": norms}


@pytest.fixture(scope="module")
def layout() -> ShardInfo:
    """The TP=2 layout, for gathering the workers' state dicts here (sharding itself needs no collective)."""
    return shard_model(tiny_llama(), 0, 2)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory) -> list[dict[str, Any]]:
    return run_workers(2, tp2_work, tmp_path_factory.mktemp("tp2"))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Within 1e-5 of the tensor's largest element: the shards sum fp32 partial products in another order."""
    scale = float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{what}: {m}")


def assert_states_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        assert actual[key].shape == expected[key].shape, f"{what} {key}"
        assert_close(actual[key], expected[key], f"{what} {key}")


# ---------------------------------------------------------------------------------------------- tests


def test_sharded_adapter_starts_as_the_single_worker_adapter(tp2, reference, layout):
    assert tp2[0]["drawn_seed"] == tp2[1]["drawn_seed"], "a seed-less adapter must start the same on every shard"
    gathered = gather_adapter_state([worker["initial"] for worker in tp2], layout)
    assert gathered.keys() == reference["initial"].keys()
    for key, value in reference["initial"].items():
        assert torch.equal(gathered[key], value), key


def test_tp2_forward_and_backward_match_one_worker(tp2, reference, layout):
    for worker in tp2:
        assert_close(worker["logits"], reference["logits"], "logits")
        assert worker["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        for actual, expected in zip(worker["logprobs"], reference["logprobs"], strict=True):
            assert_close(actual, expected, "logprobs")
    gathered = gather_adapter_state([worker["grads"] for worker in tp2], layout)
    assert_states_close(gathered, reference["grads"], "gradient")


def test_tp2_training_matches_one_worker(tp2, reference):
    for worker in tp2:
        assert worker["train"]["losses"] == pytest.approx(reference["train"]["losses"], rel=1e-5)
        assert worker["train"]["norms"] == pytest.approx(reference["train"]["norms"], rel=1e-5)
        assert_states_close(worker["final"], reference["final"], "trained weights")
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(worker["moments"][key], reference["moments"][key], key)
        assert int(worker["moments"]["step"]) == STEPS
        assert worker["restored"], "a checkpoint gathered from the shards and split again must give the shards back"


def test_tp2_sampling_gives_the_same_tokens(tp2, reference):
    assert len(reference["samples"]) == 4
    for worker in tp2:
        assert worker["samples"] == reference["samples"]


def test_tp2_with_a_bf16_base_matches_one_bf16_worker(tp2, reference, layout):
    """bf16 rounds each worker's partial sums before the all-reduce adds them: equal to bf16 precision."""
    expected = reference["bf16"]
    gathered = gather_adapter_state([worker["bf16"]["grads"] for worker in tp2], layout)
    for worker in tp2:
        assert worker["bf16"]["loss"] == pytest.approx(expected["loss"], rel=1e-2)
    for key, value in expected["grads"].items():
        error = float(torch.linalg.vector_norm(gathered[key] - value) / torch.linalg.vector_norm(value))
        assert error < 5e-2, f"{key}: relative error {error:.3g}"


@pytest.fixture(scope="module")
def tp2_dp2(tmp_path_factory) -> list[dict[str, Any]]:
    return run_workers(4, tp2_dp2_work, tmp_path_factory.mktemp("tp2-dp2"))


def test_tp2_times_dp2_matches_one_worker(tp2_dp2, reference):
    workers = tp2_dp2
    for replica in range(2):
        for worker in workers[2 * replica : 2 * replica + 2]:
            assert worker["train"]["norms"] == pytest.approx(reference["train"]["norms"], rel=1e-5)
            assert_states_close(worker["final"], reference["final"], "trained weights")
            for key in ("exp_avg", "exp_avg_sq"):
                assert_close(worker["moments"][key], reference["moments"][key], key)
    per_step = [a + b for a, b in zip(workers[0]["train"]["losses"], workers[2]["train"]["losses"], strict=True)]
    assert per_step == pytest.approx(reference["train"]["losses"], rel=1e-5)


def test_a_row_split_over_two_tensor_parallel_replicas_equals_one_worker(tp2_dp2, layout):
    """Context parallelism over replicas of a tensor-parallel group: the row's log-probs (each position from the
    replica that holds it), its loss (the replicas' shares summed) and the summed gradient equal one unsharded
    worker's on the whole row."""
    model = tiny_llama()
    adapter = AdapterState.create("a", model, LORA, device="cpu")
    adapter.load_state_dict(start_state(model))
    [output] = forward_backward(model, [ForwardItem(adapter, [long_row()], "cross_entropy")])
    whole, grads = logprobs_of(output)[0], grad_state(adapter)
    workers = [worker["split"] for worker in tp2_dp2]
    for first in (0, 1):  # either shard holder's view of the two replicas
        replicas = workers[first::2]
        assert sum(w["loss"] for w in replicas) == pytest.approx(output.metrics["loss:sum"], rel=1e-5)
        for worker in replicas:
            assert_close(worker["logprobs"], whole[worker["positions"]], "log-probs at the replica's positions")
    assert sorted(torch.cat([w["positions"] for w in workers[0::2]]).tolist()) == list(range(40))
    assert_states_close(gather_adapter_state([workers[0]["grads"], workers[1]["grads"]], layout), grads, "gradient")
    assert_states_close(gather_adapter_state([workers[2]["grads"], workers[3]["grads"]], layout), grads, "gradient")


def test_an_adapter_held_in_shards_is_put_together_and_held_whole_by_a_new_generation(tp2_dp2):
    """Re-cutting a group (`placement._recut_into`) from 2 ways to 1: the whole adapter every rank of the new
    generation takes (params, moments, step, and a summed gradient not yet applied, as one more step shows)
    equals the shards' after the same step."""
    for worker in tp2_dp2:
        recut = worker["recut"]
        assert recut["step"] == recut["expected_step"]
        assert_states_close(recut["whole"], recut["expected"], "weights")
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(recut["moments"][key], recut["expected_moments"][key], key)


def test_sharding_splits_weights_and_adapters_losslessly(layout):
    whole = tiny_llama()
    shards = [tiny_llama() for _ in range(2)]
    infos = [shard_model(model, rank, 2) for rank, model in enumerate(shards)]
    layer = "model.layers.0"
    for name, dim in (("self_attn.k_proj", 0), ("mlp.up_proj", 0), ("self_attn.o_proj", 1), ("mlp.down_proj", 1)):
        parts = [model.get_submodule(f"{layer}.{name}").weight for model in shards]
        assert torch.equal(torch.cat(parts, dim=dim), whole.get_submodule(f"{layer}.{name}").weight), name
    assert shards[1].get_submodule(f"{layer}.self_attn.k_proj").out_features == 16  # one kv head of head_dim 16
    assert torch.equal(shards[1].lm_head.weight, whole.lm_head.weight)
    state = start_state(whole)
    pieces = [shard_adapter_state(state, info) for info in infos]
    assert pieces[0]["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].shape == (32, LORA.rank)
    assert pieces[0]["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (LORA.rank, 64)
    assert_states_close(gather_adapter_state(pieces, layout), state, "round trip")


def test_shard_model_refuses_what_it_cannot_split():
    with pytest.raises(ValueError, match="2 key/value heads do not split evenly over 4 workers"):
        shard_model(tiny_llama(), 0, 4)
    with pytest.raises(ValueError, match="attach_lora"):
        shard_model(LlamaForCausalLM(tiny_llama().config), 0, 2)
    model = tiny_llama()
    shard_model(model, 0, 2)
    with pytest.raises(ValueError, match="already split"):
        shard_model(model, 1, 2)


@pytest.mark.parametrize("name", ["bios/tiny-llama", "bios/tiny-qwen3"])
def test_sharded_load_reads_only_the_shard_and_equals_load_then_split(name):
    """Loading slice by slice gives the same parameters and buffers (rotary tables, a tied head) as loading the
    whole model and splitting it."""
    for rank in range(2):
        loaded, info = load_sharded_model(resolve_model_dir(name), rank, 2)
        whole = load_base_model(name).model
        attach_lora(whole)
        assert shard_model(whole, rank, 2) == info
        expected = {**dict(whole.named_parameters()), **dict(whole.named_buffers())}
        actual = {**dict(loaded.named_parameters()), **dict(loaded.named_buffers())}
        assert actual.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(actual[key], value), key
        tied = whole.lm_head.weight is whole.get_input_embeddings().weight
        assert (loaded.lm_head.weight is loaded.get_input_embeddings().weight) == tied
