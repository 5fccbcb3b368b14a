"""Many workers: data parallelism, joins, graceful leaves, SIGKILLs mid-cycle, and losing the whole pool."""

from __future__ import annotations

import random
import signal
import time
from contextlib import contextmanager

import pytest
from conftest import BASE, assert_same_weights, saved_adapter, text_datum, train_steps, wait_for_workers

import bios
from bios import types

BATCH = [text_datum(f"Data parallel sentence number {i}, long enough to take a while to run.") for i in range(12)]
# lr 1e-3: Adam turns fp32 reduction-order noise (shards of other sizes) into weight noise in proportion to
# the learning rate; at 1e-2 one weight in a thousand drifted 1.4e-5, while a step lost or run twice moves
# every weight by about lr.
PARAMS = types.AdamParams(learning_rate=1e-3)


def _train(tc, steps):
    return train_steps(tc, BATCH, PARAMS, steps)


def _wait_until_dead(service, pid, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(w.pid == pid and w.state == "dead" for w in service.cluster_status().workers):
            return
        time.sleep(0.1)
    raise AssertionError(f"the coordinator never noticed that worker pid {pid} died")


@contextmanager
def _frozen_until_declared_dead(service, worker):
    """SIGSTOP `worker` (a starved or swapping machine) until the coordinator declares it dead; the body runs
    while it is still frozen, and it wakes on the way out."""
    worker.send_signal(signal.SIGSTOP)
    try:
        _wait_until_dead(service, worker.pid)
        yield
    finally:
        worker.send_signal(signal.SIGCONT)


@pytest.fixture(scope="module")
def reference():
    """Five steps on one worker, and its weights: what every elastic run below must reproduce."""
    with bios.LocalCluster(workers=1, worker_threads=1) as cluster, bios.ServiceClient(address=cluster.address) as svc:
        tc = svc.create_lora_training_client(BASE, rank=8, seed=51)
        losses = [f.result(120).loss for f in _train(tc, 5)[0::2]]
        ten = [f.result(120).loss for f in _train(tc, 5)[0::2]]
        return losses, losses + ten, saved_adapter(svc, tc)


@pytest.mark.e2e
def test_two_workers_equal_one(reference):
    losses, _, _ = reference
    with bios.LocalCluster(workers=2, worker_threads=1) as cluster, bios.ServiceClient(address=cluster.address) as svc:
        wait_for_workers(svc, 2)
        tc = svc.create_lora_training_client(BASE, rank=8, seed=51)
        got = [f.result(120).loss for f in _train(tc, 5)[0::2]]
        assert got == pytest.approx(losses, rel=1e-5)
        assert svc.cluster_status().generation >= 2


@pytest.mark.e2e
def test_sigkill_inside_cycles_loses_nothing_and_runs_nothing_twice(reference):
    _, losses, weights = reference
    rng = random.Random(7)
    with bios.LocalCluster(workers=2, worker_threads=1, heartbeat_timeout_s=3.0) as cluster, \
            bios.ServiceClient(address=cluster.address) as svc:
        wait_for_workers(svc, 2)
        tc = svc.create_lora_training_client(BASE, rank=8, seed=51)
        futures = []
        size = 2
        for step in range(10):
            if step == 5:
                size = 3  # 2 workers, then 3
                cluster.add_worker()
            wait_for_workers(svc, size)
            futures += _train(tc, 1)
            time.sleep(rng.uniform(0.0, 0.3))
            victim = rng.choice([w for w in cluster.workers if w.poll() is None])
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            cluster.add_worker()
            futures[-1].result(180)  # this step committed on the survivors
            # Until the coordinator notices the death, the victim still counts as active: killing the last real
            # holder of the state before the newcomer joined would lose the run, legitimately (no checkpoint).
            _wait_until_dead(svc, victim.pid)
        got = [f.result(180).loss for f in futures[0::2]]
        steps = [f.result(180).metrics["step:max"] for f in futures[1::2]]
        assert steps == list(range(1, 11))  # every optim_step ran exactly once, in order
        assert got == pytest.approx(losses, rel=1e-5)
        assert_same_weights(saved_adapter(svc, tc), weights)
        assert svc.cluster_status().generation >= 20


@pytest.mark.e2e
def test_a_fresh_cache_with_two_workers_writes_complete_builtin_models(tmp_path):
    """Both workers of a generation write the built-in model on first use; the one of rank 1 must not publish
    a directory without weights (save_pretrained writes nothing on a torch.distributed rank other than 0)."""
    with bios.LocalCluster(workers=2, worker_threads=1, env={"BIOS_CACHE_DIR": str(tmp_path)}) as cluster, \
            bios.ServiceClient(address=cluster.address) as svc:
        wait_for_workers(svc, 2)
        tc = svc.create_lora_training_client(BASE, rank=8, seed=51)
        assert tc.forward(BATCH[:2]).result(120).loss > 0
    written = {p.name for p in (tmp_path / "models" / "bios--tiny-llama").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= written


@pytest.mark.e2e
def test_a_worker_declared_dead_while_alive_registers_again(reference):
    """A worker frozen past the heartbeat timeout (SIGSTOP: a starved or swapping machine) is declared dead; when
    it wakes it is told to register again, joins as a new member with the current state, and training goes on."""
    losses, _, _ = reference
    with bios.LocalCluster(workers=2, worker_threads=1, heartbeat_timeout_s=2.0) as cluster, \
            bios.ServiceClient(address=cluster.address) as svc:
        wait_for_workers(svc, 2)
        tc = svc.create_lora_training_client(BASE, rank=8, seed=51)
        futures = _train(tc, 2)
        futures[-1].result(120)
        frozen = cluster.workers[1]
        with _frozen_until_declared_dead(svc, frozen):
            futures += _train(tc, 1)
            futures[-1].result(120)  # the survivor trains alone meanwhile
        wait_for_workers(svc, 2)
        futures += _train(tc, 2)
        assert [f.result(120).loss for f in futures[0::2]] == pytest.approx(losses, rel=1e-5)
        workers = svc.cluster_status().workers
        assert sorted(w.state for w in workers) == ["active", "active", "dead"]
        assert any(w.worker_id.endswith("-rejoin1") and w.state == "active" for w in workers)
        assert frozen.poll() is None


@pytest.mark.e2e
def test_the_only_worker_frozen_past_the_timeout_keeps_its_runs(reference):
    """The only worker is declared dead while frozen (no checkpoint exists); when it wakes and registers again it
    still holds every adapter exactly as last committed, so it is the source again and the run goes on."""
    losses, _, _ = reference
    with bios.LocalCluster(workers=1, worker_threads=1, heartbeat_timeout_s=2.0) as cluster, \
            bios.ServiceClient(address=cluster.address) as svc:
        tc = svc.create_lora_training_client(BASE, rank=8, seed=51)
        futures = _train(tc, 2)
        futures[-1].result(120)
        with _frozen_until_declared_dead(svc, cluster.workers[0]):
            pass
        futures += _train(tc, 3)
        assert [f.result(120).loss for f in futures[0::2]] == pytest.approx(losses, rel=1e-5)
        assert [f.result().metrics["step:max"] for f in futures[1::2]] == [1, 2, 3, 4, 5]
        assert "registered again holding all 1 adapter(s)" in (cluster.state_dir / "coordinator.log").read_text()


@pytest.mark.e2e
def test_graceful_leave_aborts_no_cycle(reference):
    losses, _, _ = reference
    with bios.LocalCluster(workers=2, worker_threads=1) as cluster, bios.ServiceClient(address=cluster.address) as svc:
        wait_for_workers(svc, 2)
        tc = svc.create_lora_training_client(BASE, rank=8, seed=51)
        futures = _train(tc, 2)
        cluster.workers[1].send_signal(signal.SIGTERM)
        futures += _train(tc, 3)
        assert [f.result(120).loss for f in futures[0::2]] == pytest.approx(losses, rel=1e-5)
        assert cluster.workers[1].wait(60) == 0
        log = (cluster.state_dir / "coordinator.log").read_text()
        assert "aborted" not in log


@pytest.mark.e2e
def test_losing_every_worker_resumes_from_the_automatic_checkpoint():
    with bios.LocalCluster(workers=1, worker_threads=1, checkpoint_every=2, heartbeat_timeout_s=2.0) as cluster, \
            bios.ServiceClient(address=cluster.address) as svc:
        tc = svc.create_lora_training_client(BASE, rank=8, seed=52)
        for f in _train(tc, 4):
            f.result(120)
        before = tc.forward(BATCH).result(60).loss  # runs after the cycle that saved step 4's checkpoint
        assert [c.bios_path.rsplit("/", 1)[-1] for c in
                svc.create_rest_client().list_checkpoints(tc.model_id).result().checkpoints] == \
            ["auto-000002", "auto-000004"]
        cluster.workers[0].send_signal(signal.SIGKILL)
        cluster.workers[0].wait()
        pending = tc.forward(BATCH)  # queued while no worker is alive
        time.sleep(3.0)
        assert not pending.done()
        cluster.add_worker()
        assert pending.result(180).loss == pytest.approx(before, rel=1e-6)  # state of step 4, restored
        assert tc.forward_backward(BATCH).result(60).loss == pytest.approx(before, rel=1e-6)


def test_four_runs_share_one_base_model_and_one_cycle(ticking_service):
    service = ticking_service
    clients = [service.create_lora_training_client(BASE, rank=8, seed=60 + i) for i in range(4)]
    for _attempt in range(3):  # a tick may fall between two submissions on a loaded machine: try again
        before = service.cluster_status().cycles_run
        together = [tc.forward_backward(BATCH[i:i + 3]) for i, tc in enumerate(clients)]
        results = [f.result(60) for f in together]
        if service.cluster_status().cycles_run - before == 1:
            break
    else:
        raise AssertionError("four runs' requests, submitted together, never shared a cycle")
    # No optim_step ran, so every attempt saw the initial weights: each loss is that of the run alone.
    for i in range(4):  # each equals the same run trained alone
        alone = service.create_lora_training_client(BASE, rank=8, seed=60 + i)
        assert alone.forward_backward(BATCH[i:i + 3]).result(60).loss == pytest.approx(results[i].loss, rel=1e-6)
    assert len(service.cluster_status().workers) == 1  # one worker: one copy of the base weights
