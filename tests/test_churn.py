"""Churn: three base models, six runs, four workers, and a worker leaving (gracefully or SIGKILLed) and a new one
joining every few steps while every run trains. Groups dissolve, form and move workers all along; no request is
lost or run twice, and every run ends with the losses and weights of the same steps on one unconstrained worker
(the session's). A group of one worker loses its runs' state with that worker, so the coordinator checkpoints
every step (`--checkpoint-every 1`), as a cluster that may lose any one worker must."""

from __future__ import annotations

import shutil
import signal

import pytest
from conftest import BASE, assert_same_weights, saved_adapter, text_datum, wait_for_workers

import bios
from bios import types
from bios.models.registry import resolve_model_dir

pytestmark = pytest.mark.e2e

STEPS = 18  # per run: 108 steps in all, with a worker gone and a new one joining every 4
CHURN_EVERY = 4
PARAMS = types.AdamParams(learning_rate=1e-3)
BATCHES = [[text_datum(f"Run {r}, row {i}: churn never loses a step.") for i in range(2 + r)] for r in range(6)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Three base models: the two built-in text models and a copy of one under a local directory's name."""
    copy = tmp_path_factory.mktemp("churn") / "tiny-copy"
    shutil.copytree(resolve_model_dir(BASE), copy)
    return [BASE, "bios/tiny-qwen3", str(copy)]


def _runs(service, models):
    return [service.create_lora_training_client(models[r % 3], rank=4, seed=100 + r) for r in range(6)]


def _step(clients) -> list[float]:
    futures = [(tc.forward_backward(BATCHES[r]), tc.optim_step(PARAMS)) for r, tc in enumerate(clients)]
    losses = [fb.result(180).loss for fb, _ in futures]
    for _, optim in futures:
        optim.result(180)
    return losses


@pytest.fixture(scope="module")
def reference(service, models):
    clients = _runs(service, models)
    losses = [_step(clients) for _ in range(STEPS)]
    return losses, [saved_adapter(service, tc) for tc in clients]


def test_workers_leaving_and_joining_every_few_steps_lose_nothing(models, reference):
    want_losses, want_weights = reference
    with bios.LocalCluster(workers=4, worker_threads=1, heartbeat_timeout_s=4.0, checkpoint_every=1) as cluster, \
            bios.ServiceClient(address=cluster.address) as svc:
        wait_for_workers(svc, 4)
        clients = _runs(svc, models)
        losses = []
        for step in range(STEPS):
            losses.append(_step(clients))
            if step % CHURN_EVERY == CHURN_EVERY - 1 and step < STEPS - 1:
                victim = next(w for w in cluster.workers if w.poll() is None)
                victim.send_signal(signal.SIGKILL if (step // CHURN_EVERY) % 2 else signal.SIGTERM)  # death, leave
                victim.wait(60)
                cluster.add_worker()
        for step, (got, want) in enumerate(zip(losses, want_losses)):
            assert got == pytest.approx(want, rel=1e-5), f"step {step}"
        for tc, weights in zip(clients, want_weights):
            assert_same_weights(saved_adapter(svc, tc), weights)
        status = svc.cluster_status()
        assert sorted(model for group in status.groups for model in group.models) == sorted(models)
        assert {w.state for w in status.workers if w.state != "dead"} == {"active"}  # nobody stands by
