"""The tick as one exchange (bios.coordinator.exchange): `Scheduler.schedule` hands a group's runner a plan,
`Scheduler.update` takes the cycle's whole outcome. Driven here as the runner drives it, without workers."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import BASE, text_datum

from bios import messages as m
from bios import types
from bios.coordinator.catalog import Catalog
from bios.coordinator.checkpoints import DirectoryCheckpointStore
from bios.coordinator.exchange import CycleOutcome
from bios.coordinator.membership import Member
from bios.coordinator.scheduler import Scheduler, Submit
from bios.coordinator.store import Store
from bios.wire import make_codec

RUN = "s:train:0"
INFO = types.BaseModelInfo(BASE, "/nowhere", "llama", 256, 512, 64, 2, 100_000)


@pytest.fixture
async def tick(tmp_path):
    """A scheduler with one live worker, a run created, and the group its base model is placed on."""
    store = Store(tmp_path)
    pushed: list[str] = []  # what the client was sent: RequestDone or Notice
    codec = make_codec()

    async def push(peer: bytes, frames: list) -> None:
        pushed.append(type(codec.decode([bytes(f) for f in frames]).body).__name__)

    worker = Member("w0", b"w0", "127.0.0.1", 1, "cpu", 8 << 30)
    scheduler = Scheduler(store, Catalog(store, DirectoryCheckpointStore(tmp_path / "checkpoints")), codec,
                          push, lambda: None, workers=lambda: [worker])
    store.add_session("s", "a")
    await scheduler.submit(Submit(b"client", "a", m.CreateModel("s", 0, BASE, types.LoraConfig(rank=4)), [b"x"]))
    placement = await scheduler.place()
    yield scheduler, placement.groups[0].group_id, pushed
    store.close()


def _done(plan, results, **aborted) -> CycleOutcome:
    return CycleOutcome(plan.cycle_id, plan.layout.models, tuple(results), **aborted)


async def test_work_is_taken_only_for_a_generation_formed_for_the_plans_layout(tick):
    scheduler, group_id, _ = tick
    first = scheduler.schedule(group_id, None)  # nothing formed yet: the layout, no work
    assert first.layout is not None and first.layout.models == (BASE,) and first.items == ()
    assert scheduler.runs[RUN].runnable()  # the creation still waits
    plan = scheduler.schedule(group_id, first.layout)
    assert [type(item.op) for item in plan.items] == [m.CreateModel] and plan.cycle_id > 0
    assert scheduler.schedule("no-such-group", first.layout).layout is None  # a dissolved group ends its runner


async def test_answers_go_out_only_with_the_outcome_and_an_abort_puts_the_work_back(tick):
    scheduler, group_id, pushed = tick
    layout = scheduler.schedule(group_id, None).layout
    plan = scheduler.schedule(group_id, layout)
    create = plan.items[0].request_id
    await scheduler.update(_done(plan, [], aborted=True, worker_died=True))
    assert pushed == ["Notice"] and scheduler.runs[RUN].status == "creating"  # "a worker died...: it runs again"
    assert scheduler.schedule(group_id, layout).items == ()  # its passes were halved: the group forms anew first
    layout = scheduler.schedule(group_id, None).layout
    again = scheduler.schedule(group_id, layout)  # then the aborted creation runs again, in a new cycle
    assert [item.request_id for item in again.items] == [create] and again.cycle_id > plan.cycle_id

    created = m.ModelCreated(RUN, INFO, 4, 1000)
    await scheduler.update(_done(again, [m.ItemDone(again.cycle_id, create, created, None)], aborted=False,
                                 committed={RUN: 1.5}))
    assert pushed == ["Notice", "RequestDone"]  # the answer, once the cycle's outcome is in
    assert scheduler.runs[RUN].status == "ready" and scheduler.committed == {RUN: 1.5}
    adapters = scheduler.schedule(group_id, None).adapters
    assert [spec.model_id for spec in adapters] == [RUN]  # what a newly formed generation must hold

    step = m.ForwardBackward(RUN, 1, [text_datum("tiny")], "cross_entropy")
    await scheduler.submit(Submit(b"client", "a", step, [b"x"]))
    plan = scheduler.schedule(group_id, layout)
    assert [type(item.op) for item in plan.items] == [m.ForwardBackward]
    assert scheduler.schedule(group_id, layout).items == ()  # taken once: nothing left for the next tick


async def test_a_base_model_only_samples_use_gets_a_group_and_is_let_go_once_idle(tmp_path, monkeypatch):
    """An OpenAI-style sample of a base model no run trains once waited for ever: no group held the model."""
    store = Store(tmp_path)
    codec = make_codec()

    async def push(peer: bytes, frames: list) -> None:
        pass

    worker = Member("w0", b"w0", "127.0.0.1", 1, "cpu", 8 << 30)
    scheduler = Scheduler(store, Catalog(store, DirectoryCheckpointStore(tmp_path / "checkpoints")), codec,
                          push, lambda: None, workers=lambda: [worker])
    store.add_session("s", "a")
    session = scheduler.create_sampler("a", m.CreateSamplingSession("s", 0, base_model=BASE))
    sample = m.Sample(session.sampling_session_id, 0, types.ModelInput.from_ints([1, 2]), 1,
                      types.SamplingParams(max_tokens=2))
    await scheduler.submit(Submit(b"client", "a", sample, [b"x"]))
    group = (await scheduler.place()).group_of_model(BASE)
    assert group is not None
    layout = scheduler.schedule(group.group_id, None).layout
    plan = scheduler.schedule(group.group_id, layout)
    assert [type(item.op) for item in plan.items] == [m.Sample]
    assert (await scheduler.place()).group_of_model(BASE) is not None  # its sample is running: the group stays
    result = types.SampleResponse(sequences=[types.SampledSequence(stop_reason="length", tokens=[5, 6])])
    await scheduler.update(_done(plan, [m.ItemDone(plan.cycle_id, plan.items[0].request_id, result, None)],
                                 aborted=False))
    assert (await scheduler.place()).group_of_model(BASE) is not None  # it ran lately: kept for the next one
    monkeypatch.setattr("bios.coordinator.planning.DEMAND_WINDOW_S", 0.0)
    assert (await scheduler.place()).group_of_model(BASE) is None  # idle: its workers are free again
    store.close()


async def test_a_big_batch_beside_a_small_run_is_cut_over_cycles_and_answered_once(tick, monkeypatch):
    """A 16-row batch beside a 1-row run runs in four cycles of 4 rows (bios.coordinator.cycle_share), each with
    the small run's next step, once a whole one took 100x a short cycle; it is answered once, whole; an abort or
    a new generation starts it again."""
    scheduler, group_id, pushed = tick
    small = "s:train:1"
    await scheduler.submit(Submit(b"client", "a", m.CreateModel("s", 1, BASE, types.LoraConfig(rank=4)), [b"x"]))
    layout = scheduler.schedule(group_id, None).layout
    plan = scheduler.schedule(group_id, layout)
    await scheduler.update(_done(plan, [m.ItemDone(plan.cycle_id, i.request_id, m.ModelCreated(i.op.target, INFO, 4, 1),
                                                   None) for i in plan.items], aborted=False))
    assert {run.status for run in scheduler.runs.values()} == {"ready"}
    pushed.clear()
    big = m.ForwardBackward(RUN, 1, [text_datum(f"row {i}") for i in range(16)], "cross_entropy")

    async def small_step(seq: int) -> None:
        await scheduler.submit(Submit(b"client", "a", m.ForwardBackward(small, seq, [text_datum("one")],
                                                                        "cross_entropy"), [b"x"]))

    waits = []

    def cycle() -> tuple:
        plan = scheduler.schedule(group_id, layout)
        if plan.wait_s:  # the next part waits (once) for the small run's next call: the runner asks again
            assert plan.items == ()
            waits.append(plan.wait_s)
            plan = scheduler.schedule(group_id, layout)
        parts = [(i.part, len(i.op.data)) for i in plan.items if i.op.target == RUN]
        return plan, parts, [i for i in plan.items if i.last_part]

    async def commit(plan, finished, seconds: float = 0.5) -> None:
        results = [m.ItemDone(plan.cycle_id, i.request_id, types.ForwardBackwardOutput("ArrayRecord", [], {}), None)
                   for i in finished]
        await scheduler.update(_done(plan, results, aborted=False, seconds=seconds))

    await small_step(1)
    plan, parts, finished = cycle()
    await commit(plan, finished, seconds=0.01)  # a cycle's fixed cost, about
    await scheduler.submit(Submit(b"client", "a", big, [b"x"]))
    await small_step(2)
    plan, parts, finished = cycle()
    assert parts == [(None, 16)]  # how long it takes whole is not known yet
    await commit(plan, finished, seconds=1.0)  # 100x the short one: four parts cost 3% more

    await scheduler.submit(Submit(b"client", "a", dataclasses.replace(big, seq_id=2), [b"x"]))
    await small_step(3)
    plan, parts, finished = cycle()
    assert parts == [((0, 16), 4)] and [i.op.target for i in finished] == [small]
    answered = len(pushed)
    await commit(plan, finished)
    assert len(pushed) == answered + 1  # the small step's answer; the big batch has three parts to go
    await small_step(4)
    plan, parts, _ = cycle()
    assert parts == [((4, 16), 4)]
    await scheduler.update(_done(plan, [], aborted=True))  # its pending parts are gone: it starts again
    for seq, start in ((5, 0), (6, 4), (7, 8)):
        plan, parts, finished = cycle()
        assert parts == [((start, 16), 4)]
        await commit(plan, finished)
        await small_step(seq)
    scheduler.formed(group_id, layout.workers, layout.models, {})  # a new generation: pending gradients discarded
    for start in (0, 4, 8, 12):
        plan, parts, finished = cycle()
        assert parts == [((start, 16), 4)]
        await commit(plan, finished)
    assert pushed.count("RequestDone") == 7 + 2 and scheduler.runs[RUN].queue == {}  # 7 small steps, 2 big: once
    assert len(waits) == 3  # before each later part of the last four: the small run sent nothing more

    monkeypatch.setattr("bios.coordinator.cycle_share.ACTIVE_S", 0.0)  # the small run went quiet
    await scheduler.submit(Submit(b"client", "a", dataclasses.replace(big, seq_id=3), [b"x"]))
    assert cycle()[1] == [(None, 16)]  # nobody to wait for it: whole


def test_a_request_is_cut_only_as_far_as_the_added_cycles_cost_little():
    from bios.coordinator.cycle_share import CycleCosts, rows_per_cycle

    costs = CycleCosts()
    assert costs.parts("big") == 1  # nothing measured
    costs.ran(0.04, {"small"})
    costs.ran(0.34, {"big"})  # a CPU and a tiny model: a cycle's fixed cost is an eighth of the 64-row one
    assert costs.parts("big") == 1
    costs.ran(3.0, {"big"})  # a pass of seconds (a GPU, a real model): cut into four
    assert costs.parts("big") == 4
    assert rows_per_cycle(64, 64 * 128, [128], replicas=4, parts=4) == 16
    assert rows_per_cycle(64, 64 * 128, [16 * 128], replicas=4, parts=4) is None  # 4x the other's batch: whole
    assert rows_per_cycle(64, 64 * 128, [], replicas=4, parts=4) is None  # nobody waits for it
    assert rows_per_cycle(4, 4 * 128, [1], replicas=4, parts=4) is None  # a row per replica already: whole
    assert rows_per_cycle(6, 6 * 128, [1], replicas=4, parts=4) == 4  # at least a row per replica a part
