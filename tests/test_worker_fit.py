"""A worker too small for the pool's plans waits instead of shrinking every plan to its budget.

Unit tests of the rule (`bios.coordinator.worker_fit`) and the planner that uses it, on configs the coordinator
only reads; then a real cluster of two large CPU workers and one whose `--memory-limit` cannot hold the model:
the small one waits (and `bios status` says why) while the others train like one worker; when the large ones
are killed nothing runs (the run waits, its client is told why) until a worker with room joins.
"""

from __future__ import annotations

import json
import signal
import time
from types import SimpleNamespace

import pytest
from conftest import (
    BASE,
    assert_same_weights,
    saved_adapter,
    text_datum,
    train_steps,
    wait_for_workers,
)

import bios
from bios import types
from bios.coordinator.planning import PoolPlanner
from bios.coordinator.worker_fit import fit_workers
from bios.models.memory_plan import USABLE_FRACTION, GiB, ModelShape, estimate

TINYLLAMA = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
             "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4}
LORA = types.LoraConfig(rank=8)


def _worker(worker_id: str, gib: float) -> SimpleNamespace:
    return SimpleNamespace(worker_id=worker_id, memory_bytes=int(gib * GiB), runtime_bytes=0, device="cpu",
                           holdings={})


@pytest.fixture
def model(tmp_path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(TINYLLAMA))
    return str(tmp_path)


def _need(tp: int) -> int:
    """The smallest budget that holds the model split over `tp` workers (checkpointed, fp32)."""
    found = estimate(ModelShape.from_dict(TINYLLAMA), lora_rank=LORA.rank, batch_tokens=4096, tp=tp,
                     activation_checkpointing=True)
    return int(found.total / USABLE_FRACTION) + 1


def test_the_rule_parks_workers_with_a_problem_and_says_who_serves():
    fit = fit_workers({"w1": 16 * GiB, "w2": 16 * GiB, "w3": GiB},
                      lambda budget: None if budget > 2 * GiB else "m needs 2.00 GiB per worker (replicate)")
    assert fit.serving == ("w1", "w2")
    assert fit.parked == {"w3": "worker w3 (1.00 GiB) waits: m needs 2.00 GiB per worker (replicate); "
                                "2 worker(s) with room serve it"}
    nobody = fit_workers({"w3": GiB}, lambda budget: "m needs 2.00 GiB per worker (replicate)")
    assert nobody.serving == ()
    assert nobody.parked["w3"].endswith("; no worker with room is connected")


def test_one_small_worker_waits_instead_of_shrinking_the_plan_of_two_large_ones(model):
    workers = [_worker("w1", 16), _worker("w2", 16), _worker("w3", 1)]
    planner = PoolPlanner(lambda: workers)
    choice = planner.choose(model, LORA, adapters=0)
    assert (choice.plan.tp, choice.plan.replicas, choice.plan.budget_bytes) == (1, 2, 16 * GiB)
    planner.adopt(choice)
    (worker, why), = planner.parked()
    assert worker == "w3"
    assert why.startswith(f"worker w3 (1.00 GiB) waits: {model} needs ") and why.endswith("GiB per worker; 2 worker(s) with room serve it")


def test_when_no_worker_can_hold_the_model_replicated_every_worker_serves_it_split(model):
    small = _need(2) / GiB  # TP=2 fits, one worker does not
    assert _need(1) > small * GiB
    workers = [_worker("w1", small), _worker("w2", small), _worker("w3", small)]
    planner = PoolPlanner(lambda: workers)
    planner.adopt(planner.choose(model, LORA, adapters=0))
    assert planner.plans[model].tp == 2 and planner.plans[model].budget_bytes == int(small * GiB)
    (worker, why), = planner.parked()  # two replicas of two need a fourth worker
    assert worker == "w3" and "waits for another worker to form a replica" in why


def test_when_the_large_worker_leaves_the_small_ones_wait_then_serve_a_new_plan(model):
    """The live run's plan does not fit the small workers: they wait (its state went with the large one, and
    re-splitting live runs is not supported). Once no run uses the model, the next run splits it over them."""
    small = _need(2) / GiB
    workers = [_worker("big", 32), _worker("s1", small), _worker("s2", small)]
    planner = PoolPlanner(lambda: workers)
    planner.adopt(planner.choose(model, LORA, adapters=0))
    assert planner.plans[model].tp == 1 and [w for w, _ in planner.parked()] == ["s1", "s2"]
    workers.pop(0)
    planner.replace({})
    assert [w for w, _ in planner.parked()] == ["s1", "s2"]
    planner.forget(model)
    planner.adopt(planner.choose(model, LORA, adapters=0))
    assert planner.plans[model].tp == 2 and planner.parked() == ()


def test_a_small_worker_keeps_serving_the_model_it_holds_when_a_larger_model_comes(model):
    """Each model has its own group: the large model takes a large worker from the tiny model's replicas, and
    the small worker goes on serving the tiny model instead of waiting."""
    workers = [_worker("w1", 16), _worker("w2", 16), _worker("w3", 1)]
    planner = PoolPlanner(lambda: workers)
    planner.adopt(planner.choose(BASE, LORA, adapters=0))
    assert planner.parked() == () and planner.placement.group_of_model(BASE).replicas == 3
    planner.adopt(planner.choose(model, LORA, adapters=0))
    assert planner.parked() == ()
    assert planner.placement.group_of_model(model).workers == ("w2",)
    assert planner.placement.group_of_model(BASE).workers == ("w1", "w3")
    planner.forget(model)
    planner.replace({})
    assert planner.placement.group_of_model(BASE).replicas == 3  # the big model's runs are gone: w2 comes back


# ------------------------------------------------------------------------------------ a real cluster

SEED = 5
STEPS = 3
PARAMS = types.AdamParams(learning_rate=1e-3)
BATCH = [text_datum(f"Workers of every size, sentence {i}.") for i in range(4)]
LARGE, SMALL = "4GiB", "256MiB"  # the small one is below a CPU worker's own runtime footprint: nothing fits it


@pytest.fixture(scope="module")
def one_worker(service):
    """Losses and weights of the same run on the suite's one-worker cluster."""
    tc = service.create_lora_training_client(BASE, rank=LORA.rank, seed=SEED)
    losses = [f.result(180).loss for f in train_steps(tc, BATCH, PARAMS, STEPS)[0::2]]
    return losses, saved_adapter(service, tc)


def _status_of(svc, process):
    return next(w for w in svc.cluster_status().workers if w.pid == process.pid)


def _until(condition, what, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.mark.e2e
def test_a_small_worker_waits_while_large_ones_train_and_the_run_waits_when_only_it_is_left(one_worker, caplog):
    losses, weights = one_worker
    with bios.LocalCluster(workers=2, worker_threads=1, worker_memory_limit=LARGE, checkpoint_every=1,
                           heartbeat_timeout_s=3.0) as cluster, bios.ServiceClient(address=cluster.address) as svc:
        small = cluster.add_worker(memory_limit=SMALL)
        wait_for_workers(svc, 3, states=("active", "joining", "idle", "waiting"))
        tc = svc.create_lora_training_client(BASE, rank=LORA.rank, seed=SEED)
        assert tc.get_info().memory_plan.startswith("replicate: 2 replica(s)"), tc.get_info().memory_plan
        got = [f.result(180).loss for f in train_steps(tc, BATCH, PARAMS, 2)[0::2]]
        waiting = _status_of(svc, small)
        assert waiting.state == "waiting"
        assert waiting.note.startswith(f"worker {waiting.worker_id} (0.25 GiB) waits: {BASE} needs ")
        assert waiting.note.endswith("; 2 worker(s) with room serve it")
        assert sorted(w.state for w in svc.cluster_status().workers) == ["active", "active", "waiting"]
        rest = svc.create_rest_client()
        _until(lambda: "auto-000002" in [c.bios_path.rsplit("/", 1)[-1]
                                         for c in rest.list_checkpoints(tc.model_id).result().checkpoints],
               "step 2's automatic checkpoint never appeared")

        for large in cluster.workers[:2]:  # a cycle is sent to them, then they die in it
            large.send_signal(signal.SIGSTOP)
        pending = train_steps(tc, BATCH, PARAMS, 1)
        for large in cluster.workers[:2]:
            large.send_signal(signal.SIGKILL)
            large.wait()
        _until(lambda: _status_of(svc, small).note.endswith("no worker with room is connected"),
               "the small worker never said that nobody can hold the model")
        assert _status_of(svc, small).state == "waiting"
        _until(lambda: "waits for a worker with room for its base model" in caplog.text,
               "the client was never told why its request waits")
        assert not any(f.done() for f in pending)  # only the small worker is left: nothing runs

        cluster.add_worker(memory_limit=LARGE)  # a worker with room: the run restores from step 2 and goes on
        got += [pending[0].result(180).loss]
        assert pending[1].result(180).metrics["step:max"] == STEPS
        assert got == pytest.approx(losses, rel=1e-5)
        assert_same_weights(saved_adapter(svc, tc), weights)
        assert _status_of(svc, small).state == "waiting"
        log = (cluster.state_dir / "coordinator.log").read_text()
        assert f"no live worker can hold {BASE}" in log and "restores from" in log
