"""The coordinator is no single point of loss: SIGKILLed and restarted on its state dir, or stalled, it loses no
accepted request, no acknowledged step and no run; the client's script runs on unmodified."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import sqlite3
import threading
import time

import pytest
from conftest import BASE, assert_same_weights, saved_adapter, text_datum, wait_for_workers

import torch

import bios
from bios import types as t
from bios.sdk import connection
from bios.worker.daemon import WorkerConfig, WorkerDaemon

BATCH = [text_datum("the coordinator may die at any moment"), text_datum("and the run goes on as if it had not")]
PARAMS = t.AdamParams(learning_rate=1e-3)
STEPS = 10


def _train(cluster: bios.LocalCluster, disturb=None) -> tuple[list[float], dict]:
    """STEPS pipelined steps on two workers; `disturb(step, futures)` runs after each step's requests are sent."""
    service = bios.ServiceClient(address=cluster.address)
    try:
        wait_for_workers(service, 2)
        tc = service.create_lora_training_client(BASE, rank=4, seed=11)
        futures = []
        for step in range(STEPS):
            futures.append(tc.forward_backward(BATCH))
            futures.append(tc.optim_step(PARAMS))
            if disturb is not None:
                disturb(step, futures)
        results = [future.result(300) for future in futures]
        steps = [r.metrics["step:max"] for r in results[1::2]]
        return steps, saved_adapter(service, tc)
    finally:
        service.close()


def _cluster(state_dir, heartbeat_timeout_s: float = 2.0) -> bios.LocalCluster:
    return bios.LocalCluster(workers=2, cycle_s=0.0, worker_threads=1, state_dir=state_dir, checkpoint_every=1,
                             heartbeat_timeout_s=heartbeat_timeout_s)


@pytest.fixture
def quick_reconnect(monkeypatch):
    """The SDK's session heartbeat every 0.5 s (2 s by default): a restarted coordinator is noticed, and requests
    sent while it was down are resent, within a second or two."""
    monkeypatch.setattr(connection, "HEARTBEAT_S", 0.5)


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    with _cluster(tmp_path_factory.mktemp("fault-free")) as cluster:
        steps, weights = _train(cluster)
    assert steps == list(range(1, STEPS + 1))
    return weights


def _in_a_cycle(cluster: bios.LocalCluster, rng: random.Random) -> None:
    """Wait a random moment (a step here takes a few hundred ms), then SIGKILL and restart the coordinator."""
    time.sleep(rng.uniform(0.0, 0.4))
    cluster.restart_coordinator()


def test_sigkilled_coordinator_resumes_every_run_exactly(tmp_path, fault_free):
    rng = random.Random(5)
    with _cluster(tmp_path) as cluster:
        steps, weights = _train(cluster, lambda step, futures: _in_a_cycle(cluster, rng))
        log = cluster.log_path("coordinator").read_text()
    assert steps == list(range(1, STEPS + 1))
    assert_same_weights(weights, fault_free)
    assert log.count("restored 1 run(s)") >= STEPS - 1  # every restart found the run (a kill may precede its start)
    assert "was lost" not in log
    with sqlite3.connect(tmp_path / "coordinator.sqlite3") as db:
        assert db.execute("SELECT COUNT(*) FROM requests WHERE status = 'accepted'").fetchone()[0] == 0
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_requests_sent_while_the_coordinator_is_down_are_run_once(tmp_path, fault_free, quick_reconnect):
    with _cluster(tmp_path) as cluster:
        def down_while_sending(step: int, futures: list) -> None:
            if step % 3 == 0 and step + 1 < STEPS:  # killed after sending step 3k; 3k+1 is sent while it is down
                cluster.coordinator.kill()
                cluster.coordinator.wait()
            elif step % 3 == 1:
                cluster.start_coordinator_again()

        steps, weights = _train(cluster, down_while_sending)
    assert steps == list(range(1, STEPS + 1))
    assert_same_weights(weights, fault_free)


def test_a_stalled_coordinator_keeps_its_workers_and_runs(tmp_path, fault_free):
    rng = random.Random(9)
    # A short timeout keeps four stalls of three timeouts each brief; workers heartbeat four times per timeout.
    with _cluster(tmp_path, heartbeat_timeout_s=1.0) as cluster:
        def stall(step: int, futures: list) -> None:
            """Mid-cycle on even steps (the step was just sent), idle on odd ones (after its result); the last
            steps run undisturbed after four stalls."""
            if step >= 4:
                return
            if step % 2:
                futures[-1].result(300)
            else:
                time.sleep(rng.uniform(0.0, 0.1))
            os.kill(cluster.coordinator.pid, signal.SIGSTOP)
            time.sleep(3 * cluster.heartbeat_timeout_s)
            os.kill(cluster.coordinator.pid, signal.SIGCONT)

        steps, weights = _train(cluster, stall)
        log = cluster.log_path("coordinator").read_text()
    assert steps == list(range(1, STEPS + 1))
    assert_same_weights(weights, fault_free)
    assert "stalled" in log and "was lost" not in log and " lost: no heartbeat" not in log


def test_coordinator_and_every_worker_killed_together_roll_back_nothing_acknowledged(tmp_path, fault_free):
    with _cluster(tmp_path) as cluster:
        service = bios.ServiceClient(address=cluster.address)
        wait_for_workers(service, 2)
        tc = service.create_lora_training_client(BASE, rank=4, seed=11)
        acknowledged = 0
        for _ in range(STEPS // 2):
            tc.forward_backward(BATCH)
            acknowledged = tc.optim_step(PARAMS).result(120).metrics["step:max"]
        for proc in [cluster.coordinator, *cluster.workers]:
            proc.kill()
            proc.wait()
        cluster.workers = []
        cluster.start_coordinator_again()
        cluster.add_worker()
        cluster.add_worker()
        steps = []
        for _ in range(STEPS - STEPS // 2):
            tc.forward_backward(BATCH)
            steps.append(tc.optim_step(PARAMS).result(300).metrics["step:max"])
        weights = saved_adapter(service, tc)
        service.close()
    assert acknowledged == STEPS // 2
    assert steps == list(range(STEPS // 2 + 1, STEPS + 1))  # resumed after the last acknowledged step
    assert_same_weights(weights, fault_free)


def test_the_tinker_sdk_trains_through_a_restart_over_the_gateway(tmp_path):
    import numpy as np
    import tinker
    from tinker import types as tt

    tokens = list(b"a restart is a retry, not an error")
    datum = tt.Datum(model_input=tt.ModelInput.from_ints(tokens[:-1]),
                     loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})

    def train(cluster, restart_at=()):
        with tinker.ServiceClient(base_url=cluster.http_url, api_key="tml-test") as client:
            tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
            for step in range(4):
                fwd = tc.forward_backward([datum], "cross_entropy")
                opt = tc.optim_step(tt.AdamParams(learning_rate=1e-3))
                if step in restart_at:
                    cluster.restart_coordinator()
                fwd.result(timeout=300)
                opt.result(timeout=300)
            return tc.forward([datum], "cross_entropy").result(timeout=300).loss_fn_outputs[0]["logprobs"].data

    # One cluster: the run trained without a restart, then the same run (its own session) through two.
    with bios.LocalCluster(workers=1, cycle_s=0.0, worker_threads=1, state_dir=tmp_path, http="127.0.0.1:0",
                           checkpoint_every=1) as cluster:
        expected = train(cluster)
        got = train(cluster, restart_at=(1, 2))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


async def test_a_coordinator_killed_during_a_workers_handshake_does_not_make_it_exit(tmp_path, caplog):
    """A coordinator dying mid-handshake fails the handshake without a reason, as a refusal would: a worker that
    was registering again tries again, and joins the coordinator that comes back."""
    with bios.LocalCluster(workers=0, state_dir=tmp_path, heartbeat_timeout_s=2.0) as cluster:
        service = bios.ServiceClient(address=cluster.address)
        daemon = WorkerDaemon(WorkerConfig(cluster.address, torch.device("cpu"), discover_timeout_s=20))
        running = asyncio.ensure_future(daemon.run())
        try:
            await asyncio.to_thread(wait_for_workers, service, 1)
            cluster.coordinator.kill()
            cluster.coordinator.wait()
            daemon.rejoin_requested.set()  # what the Rejoin of a restarted coordinator asks
            while not daemon.worker_id.endswith("-rejoin1"):  # its old connection is closed
                await asyncio.sleep(0.05)
            hung_up = threading.Semaphore(0)
            with socket.create_server(("127.0.0.1", int(cluster._addresses["workers"].rsplit(":", 1)[1]))) as dying:
                def hang_up_twice() -> None:
                    for _ in range(2):
                        connection_, _ = dying.accept()
                        connection_.close()
                        hung_up.release()

                threading.Thread(target=hang_up_twice, daemon=True).start()
                for _ in range(2):
                    assert await asyncio.to_thread(hung_up.acquire, timeout=30)
            await asyncio.sleep(0.2)
            assert not running.done(), running.exception()
            cluster.start_coordinator_again()
            service.close()
            service = bios.ServiceClient(address=cluster.address)
            await asyncio.to_thread(wait_for_workers, service, 1)
            assert "hung up during this worker's handshake" in caplog.text
        finally:
            service.close()
            daemon.stop_requested.set()
            if not running.done():
                await asyncio.wait_for(running, 30)
