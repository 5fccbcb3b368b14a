"""Rows as long as the workers hold: the planner sizes the longest row a worker trains, admission refuses a
longer one with its numbers, the worker checkpoints the pass of a row longer than its plan's pass, and a group of
several workers splits such a row by sequence over them (context parallelism).

The e2e tests run workers under a `--memory-limit` on tests/tp_model.py's narrow Llama with a 16k context. One
worker: the longest row the plan allows trains, pass after pass, with the worker's measured peak RSS under its
budget; a row one token longer is refused at acceptance, and the run goes on. Two and four workers: a row longer
than one of them holds trains split over them, beside short rows, and equals one unconstrained worker.
"""

from __future__ import annotations

import asyncio
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_same_weights, random_llama, saved_adapter, wait_for_workers
from test_unbalanced_cycles import random_datum
from tp_model import LONG_SHAPE, write_long_model
from transformers import LlamaConfig

import bios
from bios import spec
from bios.exceptions import BadRequestError
from bios import messages as m
from bios.coordinator.catalog import Catalog
from bios.coordinator.checkpoints import DirectoryCheckpointStore
from bios.coordinator.exchange import CycleOutcome
from bios.coordinator.membership import Member
from bios.coordinator.scheduler import Scheduler, Submit
from bios.coordinator.store import Store
from bios.models.long_rows import MLP_CHUNK_TOKENS
from bios.models.memory_plan import USABLE_FRACTION, MiB, ModelShape, choose_plan, estimate, longest_row, model_shape
from bios.types import Datum, LoraConfig, ModelInput
from bios.wire import make_codec
from bios.worker import memory_plan
from bios.worker.adapter import AdapterState
from bios.worker.context_parallel import SequenceShare, share_chunks, share_positions
from bios.worker.engine import ForwardItem, discard_gradients, forward_backward

LIMIT = 900 * MiB  # the long model's plan passes 4096 tokens here, and its longest row is ~8.9k tokens
FP32 = {"BIOS_BASE_DTYPE": "float32"}
# One worker holds rows of 4.1k-5k tokens here, two 7.4k-8.9k split and four 11k-13.3k, as the workers' measured
# runtime goes (360-400 MiB: a clean clone's measured more than a working tree's)
SPLIT_LIMIT = 700 * MiB
SPLIT_ROW = 6000  # tokens: more than one worker of SPLIT_LIMIT holds, less than two hold split
FORWARD_ROW = 11000  # tokens: more than one worker of SPLIT_LIMIT runs forward-only (10.5k), less than two do split
PARAMS = bios.types.AdamParams(learning_rate=1e-3)


def test_the_longest_row_fits_the_budget_with_checkpointing_and_one_token_more_does_not():
    shape = ModelShape.from_config(LlamaConfig(vocab_size=256, **LONG_SHAPE))
    plan = choose_plan(shape, LIMIT, lora_rank=8, batch_tokens=4096, workers=4, allow_bf16=False,
                       max_batch_tokens=16384, overhead_bytes=360 * MiB)
    one, two, four = plan.longest_row(1), plan.longest_row(2), plan.longest_row(4)
    assert plan.batch_tokens < one < two < four <= shape.max_context_length  # more workers, longer rows
    assert plan.longest_row(64) == plan.longest_row(32) >= four  # sized for groups of up to 32
    sized = partial(estimate, shape, lora_rank=8, activation_checkpointing=True, overhead_bytes=360 * MiB,
                    mlp_chunk=MLP_CHUNK_TOKENS)
    assert longest_row(sized, USABLE_FRACTION * LIMIT, plan.batch_tokens, None) == one
    assert sized(batch_tokens=one).total <= USABLE_FRACTION * LIMIT
    assert longest_row(sized, USABLE_FRACTION * LIMIT, plan.batch_tokens, None, shape, replicas=2) == two
    # Two workers split a row: each holds half its tokens' activations, and one replica's keys at a time
    assert sized(batch_tokens=two // 2 + 1).total < sized(batch_tokens=one).total
    assert two > 1.7 * one  # what splitting adds shrinks with the replicas (streamed keys, not gathered)
    assert f"rows of <= {four} tokens" in plan.describe()  # the plan over its 4 replicas
    # A forward-only row builds no graph: longer still, alone and split (on smaller workers: at LIMIT one runs
    # the whole context alone)
    small = choose_plan(shape, SPLIT_LIMIT, lora_rank=8, batch_tokens=4096, workers=4, allow_bf16=False,
                        max_batch_tokens=16384, overhead_bytes=360 * MiB)
    forward = [small.longest_row(r, forward_only=True) for r in (1, 2)]
    assert small.longest_row(1) < forward[0] < forward[1] <= shape.max_context_length
    assert small.longest_row(2) < forward[1]
    assert longest_row(partial(sized, forward_only=True), USABLE_FRACTION * SPLIT_LIMIT, small.batch_tokens,
                       shape.max_context_length, shape, replicas=2) == forward[1]
    # More memory, longer rows, up to the model's context and never below the plan's own pass
    assert longest_row(sized, USABLE_FRACTION * 4 * LIMIT, 4096, 16384) == 16384
    assert longest_row(sized, USABLE_FRACTION * LIMIT / 2, 4096, 16384) == 4096


def test_only_losses_that_sum_over_tokens_split_a_row():
    row = ModelInput.from_ints(list(range(10)))
    assert spec.splits_rows("cross_entropy", None, row) and spec.splits_rows("ppo", None, row)
    assert not spec.splits_rows("gspo", None, row)  # its sequence ratio needs the whole row
    assert not spec.splits_rows("cross_entropy", object(), row)  # a custom loss sees whole rows


def test_a_row_longer_than_the_pass_runs_checkpointed_and_equals_the_plain_pass(monkeypatch):
    monkeypatch.setattr(memory_plan, "MLP_CHUNK_TOKENS", 16)  # the row's MLPs run in chunks of 16, 16 and 8
    model = random_llama(300)
    adapter = AdapterState.create("run", model, LoraConfig(rank=4, seed=3), device="cpu")
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 300, (41,), generator=generator)
    data = [Datum(ModelInput.from_ints(tokens[:-1].tolist()), {"target_tokens": tokens[1:],
                                                               "weights": torch.ones(40)})]
    plain = forward_backward(model, [ForwardItem(adapter, data, "cross_entropy")], max_tokens_per_pass=64)[0]
    plain_grad = adapter.pending_grad.clone()
    discard_gradients(adapter)
    recomputed, chunks = [], []
    for layer in model.model.layers:  # count the recomputations: a checkpointed layer's attention runs twice
        layer.self_attn.register_forward_pre_hook(lambda *_: recomputed.append(1))
        layer.mlp.down_proj.register_forward_pre_hook(lambda _, args: chunks.append(args[0].shape[1]))
    alone = forward_backward(model, [ForwardItem(adapter, data, "cross_entropy")], max_tokens_per_pass=16)[0]
    assert len(recomputed) == 2 * len(model.model.layers)
    # every MLP call, in forward and in recomputations, took a chunk of the row's 40 positions: 16, 16, 8
    assert chunks[:3 * len(model.model.layers)] == [16, 16, 8] * len(model.model.layers) and max(chunks) == 16
    assert alone.loss == pytest.approx(plain.loss, rel=1e-6)
    torch.testing.assert_close(adapter.pending_grad, plain_grad, rtol=1e-5, atol=1e-7)
    assert not any(getattr(m, "_bios_checkpointed", False) for m in model.modules())  # the plan's way again
    assert not any("forward" in vars(layer.mlp) for layer in model.model.layers)


class _KnownRow:
    """Replicas whose shares of the row's keys and values are known in full (one process plays every replica):
    a forward pass only, since it cannot sum their gradients."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor, *, world: int) -> None:
        self.key, self.value, self.world = key, value, world

    def broadcast_from_replica_(self, tensor: torch.Tensor, replica: int = 0) -> None:
        theirs = share_positions(self.key.shape[2], self.world, replica)
        tensor.copy_(torch.stack([self.key[:, :, theirs], self.value[:, :, theirs]]))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_replicas_share_of_a_split_row_attends_as_the_whole_row_does(world):
    length, generator = 37, torch.Generator().manual_seed(world)
    query, key, value = (torch.randn(1, heads, length, 64, generator=generator) for heads in (4, 2, 2))
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(2, dim=1), value.repeat_interleave(2, dim=1), is_causal=True).transpose(1, 2)
    for rank in range(world):
        share = SequenceShare(length, world, rank, _KnownRow(key, value, world=world))
        mine = share.positions
        with torch.no_grad():
            streamed = share.attend(query[:, :, mine], key[:, :, mine], value[:, :, mine], None)
        torch.testing.assert_close(streamed, expected[:, mine], rtol=1e-5, atol=1e-5)
        whole_keys, whole_values = key.clone(), value.clone()
        by_chunks = share.attend_by_chunks(query[:, :, mine], whole_keys, whole_values, 64 ** -0.5)  # CUDA's way
        torch.testing.assert_close(by_chunks, expected[:, mine], rtol=1e-5, atol=1e-5)
    chunks = [share_chunks(length, world, rank) for rank in range(world)]
    assert sorted(p for rank in range(world) for p in share_positions(length, world, rank).tolist()) == \
        list(range(length))  # every position once
    assert all(abs((a[1] - a[0] + b[1] - b[0]) - length / world) <= 2 for a, b in chunks)  # balanced


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


@pytest.mark.e2e
def test_the_longest_planned_row_trains_under_budget_and_a_longer_one_is_refused_at_acceptance(tmp_path):
    model = str(write_long_model(tmp_path / "long"))
    with bios.LocalCluster(workers=1, worker_threads=2, worker_memory_limit=LIMIT, env=FP32) as cluster, \
            bios.ServiceClient(address=cluster.address) as svc:
        tc = svc.create_lora_training_client(model, rank=8, seed=1)
        info = tc.get_info()
        longest = info.longest_row
        assert longest is not None and 4096 < longest < LONG_SHAPE["max_position_embeddings"], info.memory_plan
        assert f"rows of <= {longest} tokens" in info.memory_plan
        status = svc.cluster_status()  # what `bios status` and the console show
        forward = info.longest_forward_row
        assert f"rows of <= {longest} tokens (forward only: <= {forward} tokens)" in status.plans[model]
        assert (status.longest_rows[model], status.longest_forward_rows[model]) == (longest, info.longest_forward_row)
        with pytest.raises(BadRequestError) as refused:
            tc.forward_backward([random_datum(100), random_datum(longest + 1)]).result(60)
        message = str(refused.value)
        assert f"data[1] has {longest + 1} tokens" in message and f"at most {longest} tokens on one worker" in message
        # A sample's key/value cache is sized too: a long prompt runs, prefilled a pass at a time; too many
        # samples of it are refused at acceptance with the cache they need
        sampler = svc.create_sampling_client(base_model=model)
        prompt = bios.types.ModelInput.from_ints(random_datum(longest).model_input.to_ints())
        params = bios.types.SamplingParams(max_tokens=2, temperature=0.0, stop=[])  # stop=[]: not even at EOS
        assert len(sampler.sample(prompt, 1, params).result(300).sequences[0].tokens) == 2
        with pytest.raises(BadRequestError) as refused:
            sampler.sample(prompt, 64, params).result(60)
        assert f"64 sample(s) of a {longest}-token prompt and 2 new tokens need" in str(refused.value)
        # the heap grows over the first passes of a long row: its peak comes later
        trained = [tc.forward_backward([random_datum(longest, seed=step)]).result(300) for step in range(2)]
        assert all(output.loss > 0 for output in trained)
        peak = _peak_rss(cluster.workers[0].pid)
        assert peak < LIMIT, f"peak RSS {peak / MiB:.0f} MiB over the {LIMIT / MiB:.0f} MiB budget"
        # A forward-only request builds no graph: its rows run longer than a trained one (to the context here).
        # A causal model's log-probs at a row's first positions do not depend on what follows: they are those of
        # the trained row it starts with (the same weights: no step yet).
        beyond = longest + 2048
        assert beyond <= info.longest_forward_row <= LONG_SHAPE["max_position_embeddings"]
        with pytest.raises(BadRequestError, match=f"at most {longest} tokens"):
            tc.forward_backward([random_datum(beyond, seed=1)]).result(60)
        whole = tc.forward([random_datum(beyond, seed=1)]).result(600).loss_fn_outputs[0]["logprobs"].to_numpy()
        np.testing.assert_allclose(whole[:longest], trained[1].loss_fn_outputs[0]["logprobs"].to_numpy(), atol=1e-4)
        peak = _peak_rss(cluster.workers[0].pid)
        assert peak < LIMIT, f"peak RSS {peak / MiB:.0f} MiB over the {LIMIT / MiB:.0f} MiB budget"
        assert tc.optim_step(bios.types.AdamParams(learning_rate=1e-3)).result(60).metrics["step:max"] == 1


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> str:
    return str(write_long_model(tmp_path_factory.mktemp("long-rows")))


SPLIT_BATCH = [random_datum(300, seed=1), random_datum(SPLIT_ROW, seed=2), random_datum(500, seed=3)]


def one_step(svc, model: str) -> tuple[float, list[np.ndarray], dict, np.ndarray]:
    """A step on SPLIT_BATCH: its loss and log-probs, the adapter after it, and then a forward of FORWARD_ROW."""
    tc = svc.create_lora_training_client(model, rank=8, seed=7)
    output = tc.forward_backward(SPLIT_BATCH).result(600)
    tc.optim_step(PARAMS).result(60)
    forward = tc.forward([random_datum(FORWARD_ROW, seed=4)]).result(600).loss_fn_outputs[0]["logprobs"].to_numpy()
    return output.loss, [r["logprobs"].to_numpy() for r in output.loss_fn_outputs], saved_adapter(svc, tc), forward


@pytest.fixture(scope="module")
def unconstrained(long_model):
    """The reference: one worker without a memory limit, the long row in one pass of its own."""
    with bios.LocalCluster(workers=1, worker_threads=2, env=FP32) as cluster, \
            bios.ServiceClient(address=cluster.address) as svc:
        return one_step(svc, long_model)


@pytest.mark.e2e
@pytest.mark.parametrize("workers", [2, 4])
def test_a_row_longer_than_one_worker_holds_trains_split_over_the_group_and_equals_one_worker(long_model,
                                                                                             unconstrained, workers):
    with bios.LocalCluster(workers=workers, worker_threads=1, worker_memory_limit=SPLIT_LIMIT, env=FP32) as cluster, \
            bios.ServiceClient(address=cluster.address) as svc:
        wait_for_workers(svc, workers)
        loss, logprobs, weights, forward = one_step(svc, long_model)
        status = svc.cluster_status()
        plan, longest, forward_longest = (status.plans[long_model], status.longest_rows[long_model],
                                          status.longest_forward_rows[long_model])
        peaks = [_peak_rss(worker.pid) for worker in cluster.workers]
    one_worker = int(plan.split("tokens per pass")[0].rsplit("<= ", 1)[1])  # one worker's longest: its pass here
    assert one_worker < SPLIT_ROW <= longest, plan  # a row no worker holds alone, which the group holds split
    # a forward-only row that no worker runs alone (its estimate: 10.5k here), split over the group too
    alone = choose_plan(model_shape(long_model), SPLIT_LIMIT, lora_rank=8, batch_tokens=4096, workers=1,
                        allow_bf16=False, overhead_bytes=360 * MiB).longest_row(1, forward_only=True)
    assert alone < FORWARD_ROW <= forward_longest, (alone, forward_longest)
    np.testing.assert_allclose(forward, unconstrained[3], rtol=1e-5, atol=1e-5)
    assert loss == pytest.approx(unconstrained[0], rel=1e-5)
    for got, want in zip(logprobs, unconstrained[1], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert_same_weights(weights, unconstrained[2])
    assert max(peaks) < SPLIT_LIMIT, f"peak RSS {[round(p / MiB) for p in peaks]} MiB over {SPLIT_LIMIT / MiB:.0f} MiB"


class _Scheduled:
    """A scheduler over two workers of SPLIT_LIMIT with the long model's run created, driven as a group's runner
    drives it (`tick`: place, form for the layout, take a cycle's items), and what its clients were sent."""

    def __init__(self, tmp_path) -> None:
        self.model = str(write_long_model(tmp_path / "long"))
        self.store, self.codec, self.pushed = Store(tmp_path), make_codec(), []
        self.live = [Member(f"w{i}", f"w{i}".encode(), "127.0.0.1", i, "cpu", SPLIT_LIMIT, runtime_bytes=360 * MiB)
                     for i in range(2)]
        self.scheduler = Scheduler(self.store, Catalog(self.store, DirectoryCheckpointStore(tmp_path / "ckpt")),
                                   self.codec, self.push, lambda: None, workers=lambda: list(self.live))
        self.store.add_session("s", "a")

    async def push(self, peer: bytes, frames: list) -> None:
        self.pushed.append(self.codec.decode([bytes(f) for f in frames]).body)

    def notices(self) -> list[str]:
        return [body.message for body in self.pushed if isinstance(body, m.Notice)]

    async def submit(self, op: m.Request) -> None:
        await self.scheduler.submit(Submit(b"c", "a", op, [b"x"]))

    async def tick(self) -> tuple[m.WorkItem, ...]:
        group = (await self.scheduler.place()).groups[0].group_id
        items = self.scheduler.schedule(group, self.scheduler.schedule(group, None).layout).items
        await asyncio.sleep(0.01)  # the notices go out
        return items

    async def created(self, splits_long_rows: bool | None = None) -> str:
        await self.submit(m.CreateModel("s", 0, self.model, LoraConfig(rank=8)))
        [create] = await self.tick()
        info = bios.types.BaseModelInfo(self.model, self.model, "llama", 256, 16384, 1, 2, 100_000,
                                        splits_long_rows=splits_long_rows)
        created = m.ModelCreated("s:train:0", info, 8, 1000)
        await self.scheduler.update(CycleOutcome(1, (self.model,), (m.ItemDone(1, create.request_id, created, None),),
                                                 aborted=False))
        return "s:train:0"


@pytest.fixture
def scheduled(tmp_path):
    cluster = _Scheduled(tmp_path)
    yield cluster
    cluster.store.close()


async def test_a_row_accepted_for_more_workers_than_remain_waits_for_them(scheduled):
    """A row split over two workers was accepted; one leaves before it runs: it waits, its client told why, and
    runs once the group has two workers again."""
    run, planner = await scheduled.created(), scheduled.scheduler.planner
    two, alone = planner.longest_row(scheduled.model), planner.plans[scheduled.model].longest_row(1)
    assert alone < two  # a row of `two` tokens needs both workers
    await scheduled.submit(m.ForwardBackward(run, 1, [random_datum(two)], "cross_entropy"))
    gone = scheduled.live.pop()
    assert await scheduled.tick() == ()  # one worker left: the row waits
    notices = scheduled.notices()
    assert notices and f"it waits for workers: data[0] has {two} tokens" in notices[-1] and str(alone) in notices[-1]
    assert await scheduled.tick() == () and scheduled.notices() == notices  # told once
    scheduled.live.append(gone)
    assert [type(item.op) for item in await scheduled.tick()] == [m.ForwardBackward]  # two workers: it runs


async def test_a_model_whose_attention_is_not_bios_s_trains_rows_one_worker_holds(scheduled):
    """A worker reports at load that the model does not run Bios's attention (Falcon, Gemma 4, ...): its long
    rows cannot split, so a row only two workers hold split is refused at acceptance, saying why, and the plan
    shown says one worker's length."""
    run = await scheduled.created(splits_long_rows=False)
    planner, plan = scheduled.scheduler.planner, scheduled.scheduler.planner.plans[scheduled.model]
    alone, two = plan.longest_row(1), plan.longest_row(2)
    assert planner.longest_row(scheduled.model) == alone < two
    forward = plan.longest_row(1, forward_only=True)  # a forward-only row too, where two would run longer ones
    assert forward < plan.longest_row(2, forward_only=True)
    assert f"rows of <= {alone} tokens (forward only: <= {forward} tokens)" in planner.describe(scheduled.model)
    with pytest.raises(BadRequestError, match=f"data\\[0\\] has {two} tokens.*at most {alone} tokens on one worker "
                       "\\(its attention is not Bios's"):
        await scheduled.submit(m.ForwardBackward(run, 1, [random_datum(two)], "cross_entropy"))
    await scheduled.submit(m.ForwardBackward(run, 2, [random_datum(alone)], "cross_entropy"))  # one worker's: taken


async def test_samples_whose_caches_do_not_fit_together_are_decoded_in_separate_cycles(scheduled):
    """Each sample's key/value cache fits a worker alone (checked at acceptance); two whose caches do not fit
    together go in two cycles, and a third that fits beside the first goes with it (a batch's rows are as long as
    its longest)."""
    await scheduled.created()
    plan = scheduled.scheduler.planner.plans[scheduled.model]
    session = scheduled.scheduler.create_sampler("a", m.CreateSamplingSession("s", 1, base_model=scheduled.model))
    params = bios.types.SamplingParams(max_tokens=8, stop=[])
    three = plan.longest_sample(3) - 8  # a prompt whose 3 rows fill the cache

    def sample(seq_id: int, length: int, rows: int) -> m.Sample:
        prompt = ModelInput.from_ints(random_datum(length, seed=seq_id).model_input.to_ints())
        return m.Sample(session.sampling_session_id, seq_id, prompt, rows, params)

    for seq_id, (length, rows) in enumerate([(three, 2), (three, 2), (100, 1)]):
        await scheduled.submit(sample(seq_id, length, rows))

    async def sampled() -> list[int]:
        return [item.op.seq_id for item in await scheduled.tick() if isinstance(item.op, m.Sample)]

    assert await sampled() == [0, 2]  # 4 rows of `three` positions would not fit; 3 rows do
    assert await sampled() == [1]
