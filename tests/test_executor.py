"""The worker's cycle executor: what it fingerprints around a cycle."""

from __future__ import annotations

from types import SimpleNamespace

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
