"""Placement in a running cluster (bios.coordinator.placement): four CPU workers whose `--memory-limit` holds
the small built-in model whole but the test's larger model only split over two (TP=2).

- The small model first, then the large one: the large one is accepted; it takes two of the small model's
  replicas and runs split over them while the small one runs unsplit on the other two.
- The large model first, then the small one: the small one gets workers of its own and runs unsplit; when one
  of its workers is SIGKILLed and a new one joins, the newcomer joins a group and nobody stands by.
Every run trains as on one unconstrained worker (the session's).
- Three models that each fit one worker but not two together: each gets a worker of its own, and no worker's
  measured peak memory goes over its budget.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from conftest import BASE, assert_same_weights, held, saved_adapter, text_datum, train_steps, wait_for_workers
from tp_model import RANK, one_model_only_memory_limit, tp2_only_memory_limit, write_mid_model, write_tp_model

import bios
from bios import types

pytestmark = pytest.mark.e2e

SEED = 31
PARAMS = types.AdamParams(learning_rate=2.5e-4, grad_clip_norm=1.0)  # see test_tp_cluster.PARAMS
BATCH = [text_datum(f"Placement sentence {i}: each model on its own workers.") for i in range(6)]


@pytest.fixture(scope="module")
def large(tmp_path_factory):
    return str(write_tp_model(tmp_path_factory.mktemp("placement-model")))


@pytest.fixture(scope="module")
def memory_limit(large) -> int:
    from pathlib import Path
    return tp2_only_memory_limit(Path(large))


@pytest.fixture(scope="module")
def reference(service, large):
    """Three steps of each model on the session's one unconstrained worker: losses and weights."""
    out = {}
    for model in (BASE, large):
        tc = service.create_lora_training_client(model, rank=RANK, seed=SEED)
        out[model] = [f.result(180).loss for f in train_steps(tc, BATCH, PARAMS, 3)[0::2]], saved_adapter(service, tc)
    return out


def _groups(svc):
    return {tuple(g.models): g for g in svc.cluster_status().groups}


def _until(condition, what, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _train(tc, steps):
    return [f.result(180).loss for f in train_steps(tc, BATCH, PARAMS, steps)[0::2]]


def test_small_model_first_then_a_large_one_each_on_its_own_workers(large, memory_limit, reference):
    with bios.LocalCluster(workers=4, worker_threads=1, worker_memory_limit=memory_limit) as cluster, \
            bios.ServiceClient(address=cluster.address) as svc:
        wait_for_workers(svc, 4, states=("active", "joining", "idle"))
        small = svc.create_lora_training_client(BASE, rank=RANK, seed=SEED)
        losses = {BASE: _train(small, 1)}
        assert _groups(svc)[(BASE,)].replicas == 4
        big = svc.create_lora_training_client(large, rank=RANK, seed=SEED)  # refused before placement
        assert big.get_info().memory_plan.startswith("tp2+checkpointing: 1 replica(s) x 2"), big.get_info()
        losses[large] = _train(big, 3)
        losses[BASE] += _train(small, 2)
        groups = _groups(svc)
        assert (groups[(BASE,)].tp, len(groups[(BASE,)].formed)) == (1, 2)
        assert (groups[(large,)].tp, len(groups[(large,)].formed)) == (2, 2)
        assert not set(groups[(BASE,)].formed) & set(groups[(large,)].formed)
        assert small.get_info().memory_plan.startswith("replicate: 2 replica(s)")
        status = svc.cluster_status()
        assert sorted(w.state for w in status.workers) == ["active"] * 4
        assert any("leave" in note and BASE in note for note in status.placement_notes), status.placement_notes
        for model, tc in ((BASE, small), (large, big)):
            assert losses[model] == pytest.approx(reference[model][0], rel=1e-5)
            assert_same_weights(saved_adapter(svc, tc), reference[model][1])


def test_large_model_first_then_a_small_one_unsplit_and_a_leave_and_join_leave_nobody_standing_by(
        large, memory_limit, reference):
    with bios.LocalCluster(workers=4, worker_threads=1, worker_memory_limit=memory_limit,
                           heartbeat_timeout_s=3.0) as cluster, bios.ServiceClient(address=cluster.address) as svc:
        wait_for_workers(svc, 4, states=("active", "joining", "idle"))
        big = svc.create_lora_training_client(large, rank=RANK, seed=SEED)
        losses = {large: _train(big, 1)}
        assert _groups(svc)[(large,)].replicas == 2
        small = svc.create_lora_training_client(BASE, rank=RANK, seed=SEED)
        losses[BASE] = _train(small, 1)
        groups = _groups(svc)
        assert groups[(BASE,)].tp == 1 and len(groups[(BASE,)].formed) == 2  # unsplit, as get_info says
        assert small.get_info().memory_plan.startswith("replicate: 2 replica(s)")
        assert len(groups[(large,)].formed) == 2

        pids = {w.worker_id: w.pid for w in svc.cluster_status().workers}
        victim = next(p for p in cluster.workers if p.pid == pids[groups[(BASE,)].formed[-1]])
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        losses[BASE] += _train(small, 1)
        losses[large] += _train(big, 1)
        cluster.add_worker(memory_limit=memory_limit)
        _until(lambda: sorted(w.state for w in svc.cluster_status().workers) == ["active"] * 4 + ["dead"],
               "a live worker stands by after the join")
        losses[BASE] += _train(small, 1)
        losses[large] += _train(big, 1)
        for model, tc in ((BASE, small), (large, big)):
            assert losses[model] == pytest.approx(reference[model][0], rel=1e-5)
            assert_same_weights(saved_adapter(svc, tc), reference[model][1])


def _peak_rss(pid: int) -> int:
    """A process's peak resident memory so far (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


def test_three_models_that_fit_one_worker_each_but_not_together_get_a_worker_each_under_budget(tmp_path_factory):
    models = [str(write_mid_model(tmp_path_factory.mktemp(f"placement-mid{i}"))) for i in range(3)]  # same weights
    limit = one_model_only_memory_limit(Path(models[0]))
    batch = [text_datum(f"Row {i} of a batch of two thousand tokens, or so, for three models at once. " * 3)
             for i in range(8)]
    with bios.LocalCluster(workers=3, worker_threads=1, worker_memory_limit=limit) as cluster, \
            bios.ServiceClient(address=cluster.address) as svc:
        wait_for_workers(svc, 3, states=("idle",))
        clients = [svc.create_lora_training_client(model, rank=RANK, seed=SEED) for model in models]
        futures = [train_steps(tc, batch, PARAMS, 2)[0::2] for tc in clients]  # the three groups run at once
        losses = [[f.result(180).loss for f in steps] for steps in futures]
        assert losses[1] == pytest.approx(losses[0], rel=1e-6) and losses[2] == pytest.approx(losses[0], rel=1e-6)
        status = svc.cluster_status()
        groups = _groups(svc)
        held = {worker: model for model in models for worker in groups[(model,)].formed}
        assert [len(groups[(model,)].formed) for model in models] == [1, 1, 1] and len(held) == 3
        for worker in status.workers:
            assert worker.models == [held[worker.worker_id]]  # what `bios status` says each worker holds
            peak = _peak_rss(worker.pid)
            assert peak <= worker.memory_bytes == limit, (
                f"{worker.worker_id} peaked at {peak / 2**30:.2f} GiB over its {limit / 2**30:.2f} GiB budget")


def test_a_model_sharing_a_worker_moves_to_workers_of_its_own_with_its_runs_state_through_a_sigkill(service):
    """One worker: two base models share it. Two more join their group as replicas; the model that came second
    (with most of the work) then moves to those two, taking its runs' state with them (they hold its adapters as
    last committed: no checkpoint is read, and the cluster has none). One mover is SIGKILLed as the move starts:
    the other is the source. Both runs train on, equal to one unconstrained worker."""
    other, steps = "bios/tiny-qwen3", {BASE: (1, 1), "bios/tiny-qwen3": (3, 2)}  # before and after the join
    want = {}
    for model, (before, after) in steps.items():
        tc = service.create_lora_training_client(model, rank=RANK, seed=SEED)
        want[model] = _train(tc, before + after), saved_adapter(service, tc)
    with bios.LocalCluster(workers=1, worker_threads=1, heartbeat_timeout_s=3.0) as cluster, \
            bios.ServiceClient(address=cluster.address) as svc:
        wait_for_workers(svc, 1)
        runs = {model: svc.create_lora_training_client(model, rank=RANK, seed=SEED) for model in steps}
        losses = {model: _train(runs[model], before) for model, (before, _) in steps.items()}
        assert [g.models for g in svc.cluster_status().groups] == [[BASE, other]]  # one worker: they share it
        cluster.add_worker()
        mover = cluster.add_worker()
        _until(lambda: [len(g.formed) for g in svc.cluster_status().groups] == [3], "the newcomers never joined")
        with held(mover):  # frozen in the move's formation (or in the shared group's last cycle with it)
            step = train_steps(runs[other], BATCH, PARAMS, 1)  # work arriving looks at the placement again
            time.sleep(0.5)
            mover.send_signal(signal.SIGKILL)
            mover.wait()
        losses[other] += [step[0].result(180).loss]
        step[1].result(180)
        losses[BASE] += _train(runs[BASE], 1)
        losses[other] += _train(runs[other], 1)
        groups = _groups(svc)
        assert set(groups) == {(BASE,), (other,)}, groups
        assert (len(groups[(BASE,)].formed), len(groups[(other,)].formed)) == (1, 1)  # the mover is gone
        got = {model: saved_adapter(svc, tc) for model, tc in runs.items()}
        log = cluster.log_path("coordinator").read_text()
    assert f"placement: {other} leaves {BASE}'s group for one of its own" in log, log[-3000:]
    assert "which holds it as its last group committed it" in log and "restores from" not in log, log[-3000:]
    for model in steps:
        assert losses[model] == pytest.approx(want[model][0], rel=1e-5)
        assert_same_weights(got[model], want[model][1])
