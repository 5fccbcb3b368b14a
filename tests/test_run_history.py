"""Run history: one point per optimizer step in the coordinator's SQLite store, bounded by thinning, kept across
a coordinator restart, read by `RestClient.get_training_run_metrics` and printed by `bios runs list|show`."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from conftest import BASE, text_datum

import bios
from bios import ids
from bios import messages as m
from bios import types as t
from bios.cli.run_report import sparkline
from bios.coordinator.history import RunHistory, StepRecorder
from bios.coordinator.store import Store

BATCH = [text_datum("history is kept per step"), text_datum("and survives a restart")]


def _point(step: int, tokens: int = 10) -> m.MetricPoint:
    return m.MetricPoint(step, step, float(step), 1.0 / step, tokens, tokens * step, 0.5, 1e-3, {"loss:sum": 1.0 / step})


def test_history_is_thinned_beyond_its_bound_keeping_the_first_and_the_newest(tmp_path):
    store = Store(tmp_path)
    history = RunHistory(store.db, max_points=10)
    for step in range(1, 101):
        history.add("run-a", _point(step))
        assert history.count("run-a") <= 10
    history.add("run-b", _point(1))
    steps = [p.step for p in history.points("run-a")]
    assert steps[0] == 1 and steps[-1] == 100 and steps == sorted(steps)
    assert steps[-3:] == [98, 99, 100]  # the newer half is never thinned
    assert history.points("run-a")[-1].total_tokens == 1000  # running totals survive thinning
    assert [p.step for p in history.points("run-b")] == [1]
    thinned = history.points("run-a", max_points=3)
    assert len(thinned) == 3 and thinned[-1].step == 100
    store.close()


def test_a_step_gathers_its_forward_backward_calls(tmp_path):
    store = Store(tmp_path)
    recorder = StepRecorder(RunHistory(store.db))
    run = "s:train:0"
    datum = BATCH[0]
    fwd = m.ForwardBackward(run, 1, [datum], "cross_entropy")
    for seq, loss in ((1, 2.0), (2, 3.0)):
        out = t.ForwardBackwardOutput("cross_entropy", [], {"loss:sum": loss, "grad_norm:max": loss})
        recorder.record(ids.request_id(run, seq), fwd, out, None, cycle_id=4)
    forward_only = m.ForwardBackward(run, 3, [datum], "cross_entropy", forward_only=True)
    recorder.record(ids.request_id(run, 3), forward_only, t.ForwardBackwardOutput("cross_entropy", [], {"loss:sum": 99.0}),
                    None, cycle_id=4)
    opt = m.OptimStep(run, 4, t.AdamParams(learning_rate=0.01))
    recorder.record(ids.request_id(run, 4), opt, t.OptimStepResponse({"learning_rate:mean": 0.01, "step:max": 1.0}), None, 4)
    recorder.record(ids.request_id(run, 5), opt, t.OptimStepResponse({"learning_rate:mean": 0.01, "step:max": 2.0}), None, 5)
    first, second = recorder.history.points(run)
    assert first.loss == pytest.approx(5.0) and first.tokens == 2 * datum.model_input.length
    assert first.grad_norm == pytest.approx(3.0) and first.learning_rate == pytest.approx(0.01)
    assert (first.step, first.cycle_id, second.step, second.cycle_id) == (1, 4, 2, 5)
    assert second.loss is None and second.total_tokens == first.total_tokens
    store.close()


def test_sparkline_spans_low_to_high():
    assert sparkline([3.0, 2.0, 1.0]) == "█▅▁"
    assert len(sparkline([float(i) for i in range(1000)], width=40)) == 40
    assert sparkline([]) == ""


def _cli(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "bios.cli", *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_history_is_recorded_survives_a_restart_and_is_printed(tmp_path):
    with bios.LocalCluster(cycle_s=0.0, worker_threads=1, state_dir=tmp_path / "state") as cluster:
        service = bios.ServiceClient(address=cluster.address)
        try:
            tc = service.create_lora_training_client(BASE, rank=4, seed=3)
            other = service.create_lora_training_client(BASE, rank=4, seed=4)
            losses = []
            for _ in range(4):
                fwd = tc.forward_backward(BATCH)
                opt = tc.optim_step(t.AdamParams(learning_rate=1e-2))
                losses.append(fwd.result(60).loss)
                grad_norm = opt.result(60).grad_norm
            other.forward_backward(BATCH[:1]).result(60)
            other.optim_step().result(60)
            path = tc.save_state("kept").result(60).path
            rest = service.create_rest_client()
            history = rest.get_training_run_metrics(tc.model_id).result()
            assert [p.step for p in history.points] == [1, 2, 3, 4]
            assert [p.loss for p in history.points] == pytest.approx(losses, rel=1e-6)
            assert history.points[-1].grad_norm == pytest.approx(grad_norm)
            assert history.points[-1].learning_rate == pytest.approx(1e-2)
            tokens = sum(d.model_input.length for d in BATCH)
            assert [p.total_tokens for p in history.points] == [tokens * i for i in range(1, 5)]
            assert history.summary.steps == 4 and history.summary.last_checkpoint == path

            cluster.restart_coordinator()
            after = asyncio.run(rest.get_training_run_metrics_async(tc.model_id))
            assert after.points == history.points
            summaries = rest.list_run_summaries().result()
            assert {(s.training_run_id, s.steps) for s in summaries.runs} == {(tc.model_id, 4), (other.model_id, 1)}
        finally:
            service.close()
        shown = _cli("runs", "show", tc.model_id, "--address", cluster.address)
        assert "steps       4" in shown and path in shown
        assert sparkline(losses) in shown
        trace = json.loads(_cli("runs", "trace", tc.model_id, "--address", cluster.address))
        spans = {(e["cat"], e["name"]): e for e in trace["traceEvents"] if e["ph"] == "X"}
        for seq in range(1, 9):  # forward_backward, optim_step, ... as sent
            name = f"{'ForwardBackward' if seq % 2 else 'OptimStep'} #{seq}"
            waiting, running = spans[("waiting", name)], spans[("running", name)]
            assert running["args"]["cycle_id"] > 0 and running["args"]["status"] == "done"
            assert waiting["ts"] + waiting["dur"] == pytest.approx(running["ts"], abs=1.0)
        listing = _cli("runs", "list", "--address", cluster.address)
        row = next(line for line in listing.splitlines() if line.startswith(tc.model_id))
        assert row.split()[1:4] == ["ready", "4", f"{losses[-1]:.4g}"] and row.split()[4] == str(4 * tokens)
