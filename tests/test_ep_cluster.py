"""Expert parallelism in the running cluster: workers whose `--memory-limit` cannot hold a MoE model train it
with its routed experts split over two of them, with the losses and weights of one unconstrained worker, and
a SIGKILLed expert holder is replaced from the run's automatic checkpoint.

The model is tests/tp_model.py's random Qwen3-MoE (16 experts of width 1024 per layer), written to a local
directory.
"""

from __future__ import annotations

import signal
import time

import pytest
from conftest import assert_same_weights, saved_adapter, text_datum, train_steps, wait_for_workers
from tp_model import RANK, tp2_only_memory_limit, write_moe_model

import bios
from bios import types

pytestmark = pytest.mark.e2e

SEED = 29
STEPS = 4
# Adam moves a weight by ~lr however small its gradient (eps is 1e-12 by default), and an expert that saw one or
# two tokens, or whose B is still near zero, has gradients at the rounding level of the split's other summation
# order: eps 1e-6 keeps those weights from taking opposite full steps, so the comparison tests the gradients.
PARAMS = types.AdamParams(learning_rate=1e-3, eps=1e-6, grad_clip_norm=1.0)
BATCH = [text_datum(f"Expert parallel sentence {i}: every token goes to two of sixteen experts.") for i in range(4)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_moe_model(tmp_path_factory.mktemp("moe-model"))


@pytest.fixture(scope="module")
def reference(model_dir, service):
    """One unconstrained worker (the session's): the losses and weights the split run must reproduce."""
    tc = service.create_lora_training_client(str(model_dir), rank=RANK, seed=SEED)
    assert tc.get_info().memory_plan.startswith("replicate:")
    losses = [f.result(300).loss for f in train_steps(tc, BATCH, PARAMS, STEPS)[0::2]]
    return losses, saved_adapter(service, tc)


def test_a_moe_model_too_big_for_one_worker_trains_split_by_experts_and_survives_a_sigkill(model_dir, reference):
    losses, weights = reference
    limit = tp2_only_memory_limit(model_dir)
    with bios.LocalCluster(workers=2, worker_threads=1, worker_memory_limit=limit, checkpoint_every=1,
                           heartbeat_timeout_s=3.0) as cluster, bios.ServiceClient(address=cluster.address) as svc:
        wait_for_workers(svc, 2, states=("active", "joining", "idle"))
        tc = svc.create_lora_training_client(str(model_dir), rank=RANK, seed=SEED)
        plan = tc.get_info().memory_plan
        assert plan.startswith("tp2+checkpointing: 1 replica(s) x 2 tensor-parallel worker(s)"), plan
        got = [f.result(300).loss for f in train_steps(tc, BATCH, PARAMS, 2)[0::2]]
        rest_client = svc.create_rest_client()
        deadline = time.monotonic() + 60  # written in step 2's cycle, just after the step's result is sent
        while "auto-000002" not in [c.bios_path.rsplit("/", 1)[-1]
                                    for c in rest_client.list_checkpoints(tc.model_id).result().checkpoints]:
            assert time.monotonic() < deadline, "step 2's automatic checkpoint never appeared"
            time.sleep(0.1)
        victim = cluster.workers[1]  # holds experts 8-15 of every layer, and their adapters
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        cluster.add_worker()
        futures = train_steps(tc, BATCH, PARAMS, STEPS - 2)
        got += [f.result(300).loss for f in futures[0::2]]
        steps = [f.result(300).metrics["step:max"] for f in futures[1::2]]
        assert steps == list(range(3, STEPS + 1))
        assert got == pytest.approx(losses, rel=1e-5)
        assert_same_weights(saved_adapter(svc, tc), weights)
        assert "restores from" in (cluster.state_dir / "coordinator.log").read_text()
