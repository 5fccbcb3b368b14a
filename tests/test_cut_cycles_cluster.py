"""A big batch cut over cycles beside a small run (bios.coordinator.cycle_share), in a running cluster of two
CPU workers: `BIOS_CUT_COST` lets it cut whenever a small run is active (a CPU and the tiny model would not pay
for it). The big run trains exactly as a twin that ran whole, and the cycles it was cut into let the small run in.
"""

from __future__ import annotations

import threading
import time

import pytest
from conftest import BASE, assert_same_weights, saved_adapter, text_datum, wait_for_workers

import bios
from bios import types

pytestmark = pytest.mark.e2e

PARAMS = types.AdamParams(learning_rate=1e-3)
BIG = [text_datum(f"Row {i} of a batch sixteen times the small run's.") for i in range(16)]
SMALL = [text_datum("The small run's one row.")]


def test_a_big_batch_cut_over_cycles_trains_as_whole_and_lets_a_small_run_step_meanwhile():
    env = {"BIOS_CUT_COST": "100", "BIOS_BASE_DTYPE": "float32"}
    with bios.LocalCluster(workers=2, worker_threads=1, env=env) as cluster, \
            bios.ServiceClient(address=cluster.address) as service:
        wait_for_workers(service, 2)
        twin, big, small = (service.create_lora_training_client(BASE, rank=4, seed=seed) for seed in (5, 5, 6))
        big.forward(BIG).result(120)  # whole, forward only: how long the batch takes whole is measured
        stop, small_steps = threading.Event(), []

        def small_loop() -> None:
            while not stop.is_set():
                small.forward_backward(SMALL).result(120)
                small.optim_step(PARAMS).result(120)
                small_steps.append(1)

        thread = threading.Thread(target=small_loop)
        thread.start()
        try:
            while not small_steps:
                time.sleep(0.01)
            cycles = service.cluster_status().cycles_run
            cut = big.forward_backward(BIG).result(120)  # beside the small run: four cycles of 4 rows
            cycles = service.cluster_status().cycles_run - cycles
            big.optim_step(PARAMS).result(120)
        finally:
            stop.set()
            thread.join()
        assert cycles >= 4
        whole = twin.forward_backward(BIG).result(120)  # whole: the twin's first batch (nothing measured yet)
        twin.optim_step(PARAMS).result(120)
        assert len(cut.loss_fn_outputs) == len(BIG)  # answered once, whole
        assert cut.loss == pytest.approx(whole.loss, rel=1e-5)
        for a, b in zip(cut.loss_fn_outputs, whole.loss_fn_outputs, strict=True):
            assert a["logprobs"].tolist() == pytest.approx(b["logprobs"].tolist(), abs=1e-5)
        assert_same_weights(saved_adapter(service, big), saved_adapter(service, twin))
