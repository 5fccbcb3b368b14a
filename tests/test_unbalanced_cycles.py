"""A pass that keeps one worker busy far longer than its peers: no livelock.

Whether a worker is alive is the heartbeats' call; a collective may wait for a busier peer up to the collective
timeout (bios-coordinator --collective-timeout, 10 minutes by default). A batch of one 6k-token row and three rows
20x shorter: the long row goes whole to one worker while the others wait at the first collective for several
heartbeat timeouts, on 2 workers and on 4: the step completes, equal to one worker's. Where a pass outlasts even
the collective timeout, its cycle aborts with every worker alive: the request runs again in a cycle of its own,
then fails with an error that says why, and nobody else's does.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_same_weights, saved_adapter, text_datum, wait_for_workers
from tp_model import write_long_model

import bios
from bios import types
from bios.exceptions import BiosAPIError

pytestmark = pytest.mark.e2e

SEED = 41
LONG_ROW = 6144  # tokens: ~5 s of forward and backward on one thread here, over three heartbeat timeouts
HEARTBEAT_TIMEOUT_S = 1.5
DOOMED_ROW = 2048  # tokens: ~1.3 s of forward and backward on one thread here, over twice a 0.5 s collective timeout
PARAMS = types.AdamParams(learning_rate=1e-3)
FP32 = {"BIOS_BASE_DTYPE": "float32"}  # equal to one worker to 1e-5 in fp32, on any CPU


def random_datum(length: int, seed: int = SEED) -> types.Datum:
    tokens = np.random.default_rng(seed).integers(0, 256, length + 1)
    return types.Datum(types.ModelInput.from_ints(tokens[:-1].tolist()),
                       {"target_tokens": tokens[1:], "weights": np.ones(length, dtype=np.float32)})


# The long row first, then three 20x shorter: token-balanced shards give the long row a worker of its own.
UNBALANCED = [random_datum(LONG_ROW)] + [random_datum(LONG_ROW // 20, seed=SEED + i) for i in (1, 2, 3)]


def one_long_step(svc, model_dir) -> tuple[float, dict]:
    """One forward_backward of the unbalanced batch and one optimizer step: the loss and the weights after it."""
    tc = svc.create_lora_training_client(str(model_dir), rank=8, seed=SEED)
    loss = tc.forward_backward(UNBALANCED).result(600).loss
    tc.optim_step(PARAMS).result(600)
    return loss, saved_adapter(svc, tc)


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    return write_long_model(tmp_path_factory.mktemp("long-model"))


@pytest.fixture(scope="module")
def one_worker(long_model):
    with bios.LocalCluster(workers=1, worker_threads=1, env=FP32) as cluster, \
            bios.ServiceClient(address=cluster.address) as svc:
        return one_long_step(svc, long_model)


@pytest.mark.parametrize("workers", [2, 4])
def test_a_pass_several_heartbeat_timeouts_longer_on_one_worker_completes_and_equals_one_worker(long_model,
                                                                                                 one_worker, workers):
    loss, weights = one_worker
    with bios.LocalCluster(workers=workers, worker_threads=1, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
                           env=FP32) as cluster, bios.ServiceClient(address=cluster.address) as svc:
        wait_for_workers(svc, workers)
        got_loss, got_weights = one_long_step(svc, long_model)
        log = (cluster.state_dir / "coordinator.log").read_text()
        assert " aborted" not in log, log[-3000:]  # the waiting worker was never given up on
        assert sum(w.state == "active" for w in svc.cluster_status().workers) == workers
    assert got_loss == pytest.approx(loss, rel=1e-5)
    assert_same_weights(got_weights, weights)


def test_a_pass_longer_than_the_collective_timeout_fails_alone_and_says_why(long_model, caplog):
    with bios.LocalCluster(workers=2, worker_threads=1, cycle_s=1.0, collective_timeout_s=0.5, env=FP32) as cluster, \
            bios.ServiceClient(address=cluster.address) as svc:
        wait_for_workers(svc, 2)
        long = svc.create_lora_training_client(str(long_model), rank=8, seed=SEED)
        short = svc.create_lora_training_client(str(long_model), rank=8, seed=SEED + 1)
        batch = [text_datum("a short row beside a long one")]
        # Both in one cycle, most likely (the clock ticks every second): the short one must not share the long one's
        # fate either way.
        doomed, fine = long.forward_backward([random_datum(DOOMED_ROW)]), short.forward_backward(batch)
        assert fine.result(600).loss > 0
        with pytest.raises(BiosAPIError) as failed:
            doomed.result(600)
        message = str(failed.value)
        assert "two cycles that aborted with every worker alive, the second with no other request" in message
        assert f"{DOOMED_ROW} tokens in 1 rows (the longest {DOOMED_ROW})" in message
        assert "--collective-timeout" in message
        assert "runs again in a cycle of its own" in caplog.text  # the client was told after the first stall
        # Not a livelock: the cluster goes on, the long run included.
        assert short.optim_step(PARAMS).result(120).metrics["step:max"] == 1
        assert long.forward_backward(batch).result(120).loss > 0
        assert sum(w.state == "active" for w in svc.cluster_status().workers) == 2
