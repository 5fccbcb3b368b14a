"""The worker's cycle executor: what it fingerprints around a cycle."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bios import messages as m
from bios import types
from bios.worker.adapter_kinds import WholeAdapter
from bios.worker.executor import CycleExecutor


class _Pool:
    """Held adapters whose checksums count their calls; `adapter` finds none (the op fails alone)."""

    def __init__(self, *model_ids: str) -> None:
        self.calls: list[str] = []
        self.adapters = {mid: WholeAdapter(SimpleNamespace(model_id=mid, checksum=lambda mid=mid: self._checksum(mid)),
                                           None, "base")
                         for mid in model_ids}

    def _checksum(self, model_id: str) -> float:
        self.calls.append(model_id)
        return float(len(model_id))

    def adapter(self, model_id: str):
        raise KeyError(f"no {model_id} here")


def test_a_cycle_fingerprints_only_the_adapters_it_works_on():
    pool = _Pool("run-a", "run-bb", "run-ccc")
    executor = CycleExecutor(pool, group=SimpleNamespace(tp=1))  # no collective
    reports = []
    step = m.OptimStep("run-bb", 0, types.AdamParams())
    outcome = executor.run(m.RunCycle(1, 0, [m.WorkItem("step", step)]), reports.append)
    assert reports[-1].request_id == "step" and reports[-1].error  # failed alone: the pool lends nothing
    assert outcome.before == {"run-bb": 6.0}  # as the cycle began
    assert pool.calls == ["run-bb", "run-bb"]  # before and after it; the others not at all
    assert executor.held_checksums() == {"run-a": 5.0, "run-bb": 6.0, "run-ccc": 7.0}  # registering: all


class _Alone:
    """A generation of one member: every collective is the identity."""

    tp, replicas, replica, rank, world = 1, 1, 0, 0, 1

    def all_gather_replicas(self, local):
        return [local]

    def all_reduce_replicas_(self, tensor) -> None:
        pass

    def settle(self) -> None:
        pass


def test_a_request_cut_over_cycles_trains_and_answers_as_it_would_whole(monkeypatch):
    """Parts leave their gradient pending and report nothing; the last part commits them all and reports the
    whole request's output (bios.coordinator.cycle_share cuts big batches beside small runs)."""
    import torch
    from conftest import BASE, text_datum

    from bios.worker.pool import ModelPool

    monkeypatch.setenv("BIOS_BASE_DTYPE", "float32")  # sums in another order: equal to fp32 rounding
    pool = ModelPool(torch.device("cpu"))
    executor = CycleExecutor(pool, group=_Alone())
    whole, cut = (pool.create(m.CreateModel("s", i, BASE, types.LoraConfig(rank=4, seed=7))).model_id for i in (0, 1))
    data = [text_datum(f"row {i} of a batch too big for one cycle" + "!" * i) for i in range(7)]
    reports = []
    executor.run(m.RunCycle(1, 0, [m.WorkItem("whole", m.ForwardBackward(whole, 0, data, "cross_entropy"))]),
                 reports.append)
    before = pool.adapter(cut).state.checksum()
    for cycle, (start, stop) in enumerate([(0, 3), (3, 5), (5, 7)], start=2):
        op = m.ForwardBackward(cut, 0, data[start:stop], "cross_entropy")
        outcome = executor.run(m.RunCycle(cycle, 0, [m.WorkItem("cut", op, (start, len(data)))]), reports.append)
        if stop < len(data):  # nothing reported, nothing committed: the cycle leaves the adapter as it was
            assert [r.request_id for r in reports] == ["whole"] and outcome.checksums == {}
            assert pool.adapter(cut).state.checksum() == before
    assert [r.request_id for r in reports] == ["whole", "cut"] and executor.parts == {}
    expected, got = reports[0].result, reports[1].result
    assert got.metrics == pytest.approx(expected.metrics, rel=1e-5)
    assert len(got.loss_fn_outputs) == len(data)
    for a, b in zip(expected.loss_fn_outputs, got.loss_fn_outputs, strict=True):
        assert b["logprobs"].tolist() == pytest.approx(a["logprobs"].tolist(), abs=1e-5)
    grad = pool.adapter(whole).state.grad
    torch.testing.assert_close(pool.adapter(cut).state.grad, grad, rtol=1e-5, atol=1e-5 * grad.abs().max().item())
