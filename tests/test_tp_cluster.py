"""Tensor parallelism in the running cluster: workers whose `--memory-limit` is too small for a model train it
split over two of them (TP=2), and over four as 2 replicas x 2 shards, with the results of one unconstrained
worker; sampling gives the same tokens; a SIGKILLed shard holder is replaced from a replica of its shard; a
model that fits nowhere is refused when the run is created.

The model is tests/tp_model.py's random Llama, written to a local directory.
"""

from __future__ import annotations

import json
import signal
import time

import pytest
from conftest import assert_same_weights, saved_adapter, text_datum, train_steps, wait_for_workers
from tp_model import RANK, tp2_only_memory_limit, write_tp_model

import bios
from bios import types
from bios.exceptions import BadRequestError

pytestmark = pytest.mark.e2e

SEED = 23
STEPS = 4
# Adam moves every weight by ~lr whatever its gradient, so weights whose gradient is at the rounding level of
# the shards' different summation order move by up to ~lr differently. oneDNN's fp32 GEMM (the CPU default,
# bios/kernels/frozen_matmul.py) rounds ~3x more than MKL's, so a row-parallel shard's partial sums stray ~5x
# further from the whole product's: at lr 1e-3 one weight in 12288 strayed by 3.3e-5; lr 2.5e-4 keeps them within
# 1e-5 (the session's worker, which trains the reference, runs the default GEMM, so the shards do too).
PARAMS = types.AdamParams(learning_rate=2.5e-4, grad_clip_norm=1.0)
BATCH = [text_datum(f"Tensor parallel sentence {i}: heads and columns split over workers.") for i in range(6)]
PROMPT = types.ModelInput.from_ints(list(b"Tensor parallel"))
GREEDY = types.SamplingParams(max_tokens=12, temperature=0.0, stop=[])
SEEDED = types.SamplingParams(max_tokens=12, temperature=1.0, seed=7, stop=[])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The test model, written once; its config is all the coordinator reads to plan."""
    return write_tp_model(tmp_path_factory.mktemp("tp-model"))


@pytest.fixture(scope="module")
def memory_limit(model_dir) -> int:
    """A budget between the TP=2 plan's estimate and the smallest single-worker plan's, so only TP=2 fits."""
    return tp2_only_memory_limit(model_dir)


def _train(tc, steps):
    return train_steps(tc, BATCH, PARAMS, steps)


def _samples(tc):
    """Tokens and their log-probs of a greedy and a seeded sample of two sequences each."""
    sampler = tc.save_weights_and_get_sampling_client()
    sequences = [seq for params in (GREEDY, SEEDED) for seq in sampler.sample(PROMPT, 2, params).result(120).sequences]
    return [seq.tokens for seq in sequences], [lp for seq in sequences for lp in seq.logprobs]


def _wait_for_workers(service, n):
    wait_for_workers(service, n, states=("active", "joining", "idle"))


def _finish_like_one_worker(svc, tc, first_losses, reference):
    """Steps 3.. after a failure: each runs once, and losses and weights equal the single worker's."""
    losses, weights, _ = reference
    futures = _train(tc, STEPS - 2)
    rest = [f.result(180).loss for f in futures[0::2]]
    steps = [f.result(180).metrics["step:max"] for f in futures[1::2]]
    assert steps == list(range(3, STEPS + 1))
    assert first_losses + rest == pytest.approx(losses, rel=1e-5)
    assert_same_weights(saved_adapter(svc, tc), weights)


@pytest.fixture(scope="module")
def reference(model_dir, service):
    """One unconstrained worker (the session's): losses, weights and samples every tensor-parallel run must
    reproduce."""
    tc = service.create_lora_training_client(str(model_dir), rank=RANK, seed=SEED)
    assert tc.get_info().memory_plan.startswith("replicate:")
    losses = [f.result(180).loss for f in _train(tc, STEPS)[0::2]]
    return losses, saved_adapter(service, tc), _samples(tc)


def test_a_model_too_big_for_one_worker_trains_over_two_like_one_worker(model_dir, memory_limit, reference):
    losses, weights, samples = reference
    with bios.LocalCluster(workers=2, worker_threads=1, worker_memory_limit=memory_limit) as cluster, \
            bios.ServiceClient(address=cluster.address) as svc:
        _wait_for_workers(svc, 2)
        tc = svc.create_lora_training_client(str(model_dir), rank=RANK, seed=SEED)
        plan = tc.get_info().memory_plan
        assert plan.startswith("tp2+checkpointing: 1 replica(s) x 2 tensor-parallel worker(s)"), plan
        assert svc.cluster_status().plans[str(model_dir)] == plan
        got = [f.result(180).loss for f in _train(tc, STEPS)[0::2]]
        assert got == pytest.approx(losses, rel=1e-5)
        assert_same_weights(saved_adapter(svc, tc), weights)
        tokens, logprobs = _samples(tc)
        assert tokens == samples[0]
        assert logprobs == pytest.approx(samples[1], abs=1e-4)


def test_a_model_that_fits_nowhere_is_refused_and_one_blocked_by_live_runs_shares_their_workers_cut_in_two(
        tmp_path, model_dir, memory_limit, reference):
    """Only config.json is read: the refusal comes before any worker loads anything. A model that needs both
    workers while another model's runs hold them unsplit is placed at once: the live runs' adapters are cut in
    two, state and all (a run that stepped and summed a gradient before the cut ends equal to one that trained
    after it only), and the two models share the workers. When two more join, each model gets a group of its
    own again, the built-in one whole, with nothing lost."""
    huge = tmp_path / "huge"
    huge.mkdir()
    (huge / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
                                                  "intermediate_size": 8192, "num_hidden_layers": 16,
                                                  "num_attention_heads": 32, "num_key_value_heads": 8}))
    with bios.LocalCluster(workers=2, worker_threads=1, worker_memory_limit=memory_limit) as cluster, \
            bios.ServiceClient(address=cluster.address) as svc:
        _wait_for_workers(svc, 2)
        with pytest.raises(BadRequestError) as caught:
            svc.create_lora_training_client(str(huge), rank=RANK)
        message = str(caught.value)
        assert f"model {huge} needs ~" in message and "even with TP=2 and activation checkpointing" in message
        assert "TP=3 needs 3 workers, the pool has 2" in message
        before, after = (svc.create_lora_training_client("bios/tiny-llama", rank=RANK, seed=SEED) for _ in range(2))
        for future in [*_train(before, 1), before.forward_backward(BATCH)]:  # a step, and a gradient not applied
            future.result(120)
        big = svc.create_lora_training_client(str(model_dir), rank=RANK, seed=SEED)  # no wait for workers
        status = svc.cluster_status()  # as `bios status` shows it
        assert any(note.startswith("bios/tiny-llama cut over 2 workers, so ") for note in status.placement_notes), \
            status.placement_notes
        assert status.plans["bios/tiny-llama"].startswith("tp2"), status.plans  # the plan run, not the first one
        before.optim_step(PARAMS).result(120)
        for future in _train(after, 2):
            future.result(120)
        weights = saved_adapter(svc, before)
        assert_same_weights(weights, saved_adapter(svc, after))
        loss = before.forward(BATCH).result(120).loss
        assert loss == pytest.approx(after.forward(BATCH).result(120).loss, rel=1e-5)
        assert big.forward(BATCH).result(120).loss == pytest.approx(reference[0][0], rel=1e-5)
        # Two workers join as a replica of both; then the split model leaves with them (its shards go along)
        # and the built-in model is put back together on the first two: nothing changes but where they run
        cluster.add_worker()
        cluster.add_worker()
        deadline = time.monotonic() + 180
        while not svc.cluster_status().plans["bios/tiny-llama"].startswith("replicate: 2 replica(s)") or \
                sum(w.state == "active" for w in svc.cluster_status().workers) < 4:
            assert time.monotonic() < deadline, svc.cluster_status()
            big.forward(BATCH[:1]).result(120)  # work, so the placement is looked at again
            time.sleep(0.2)
        status = svc.cluster_status()
        assert any(f"{model_dir} leaves bios/tiny-llama's group for one of its own" in note
                   for note in status.placement_notes), status.placement_notes
        assert any("bios/tiny-llama cut back to one worker a replica" in note for note in status.placement_notes)
        assert "1 replica(s) x 2 tensor-parallel worker(s)" in status.plans[str(model_dir)], status.plans
        assert_same_weights(saved_adapter(svc, before), weights, tol=1e-6)
        assert before.forward(BATCH).result(120).loss == pytest.approx(loss, rel=1e-5)
        assert big.forward(BATCH).result(120).loss == pytest.approx(reference[0][0], rel=1e-5)


def test_tp2_by_dp2_equals_one_worker_and_survives_a_sigkilled_shard_holder(model_dir, memory_limit, reference):
    """Four constrained workers: 2 replicas x 2 shards. After two steps one of them is killed; the three
    survivors form one replica of two (both shards survive in some replica) and one stands by."""
    with bios.LocalCluster(workers=4, worker_threads=1, worker_memory_limit=memory_limit,
                           heartbeat_timeout_s=3.0) as cluster, bios.ServiceClient(address=cluster.address) as svc:
        _wait_for_workers(svc, 4)
        tc = svc.create_lora_training_client(str(model_dir), rank=RANK, seed=SEED)
        assert tc.get_info().memory_plan.startswith("tp2+checkpointing: 2 replica(s) x 2"), tc.get_info().memory_plan
        futures = _train(tc, 2)
        first = [f.result(180).loss for f in futures[0::2]]
        victim = cluster.workers[1]
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        _finish_like_one_worker(svc, tc, first, reference)
        states = sorted(w.state for w in svc.cluster_status().workers)
        assert states == ["active", "active", "dead", "joining"], states


def test_a_shard_no_survivor_holds_restores_from_the_automatic_checkpoint(model_dir, memory_limit, reference):
    """TP=2 on exactly two workers: killing one leaves its shard on no survivor, so when a worker comes back the
    run restores from its latest automatic checkpoint (one per step here) and goes on as if nothing happened."""
    with bios.LocalCluster(workers=2, worker_threads=1, worker_memory_limit=memory_limit, checkpoint_every=1,
                           heartbeat_timeout_s=3.0) as cluster, bios.ServiceClient(address=cluster.address) as svc:
        _wait_for_workers(svc, 2)
        tc = svc.create_lora_training_client(str(model_dir), rank=RANK, seed=SEED)
        first = [f.result(180).loss for f in _train(tc, 2)[0::2]]
        rest_client = svc.create_rest_client()
        deadline = time.monotonic() + 60  # it is written in step 2's cycle, just after the step's result is sent
        while "auto-000002" not in [c.bios_path.rsplit("/", 1)[-1]
                                    for c in rest_client.list_checkpoints(tc.model_id).result().checkpoints]:
            assert time.monotonic() < deadline, "step 2's automatic checkpoint never appeared"
            time.sleep(0.1)
        victim = cluster.workers[1]
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        cluster.add_worker()
        _finish_like_one_worker(svc, tc, first, reference)
        assert "restores from" in (cluster.state_dir / "coordinator.log").read_text()
