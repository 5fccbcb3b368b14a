"""One request spec, checked at acceptance: a tenant's bad request fails only itself, replicas agree from step
one, and a creation that fails leaves nothing behind."""

from __future__ import annotations

import asyncio
import math
import random

import numpy as np
import pytest
import torch
from conftest import BASE, assert_same_weights, random_llama, saved_adapter, text_datum, train_steps, wait_for_workers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bios
from bios import ids, spec
from bios import messages as m
from bios import types as t
from bios.coordinator.admission import Admission, Fresh, Refused, Submit
from bios.coordinator.catalog import Catalog
from bios.coordinator.checkpoints import DirectoryCheckpointStore
from bios.coordinator.planning import PoolPlanner
from bios.coordinator.runs import Run
from bios.coordinator.store import Store
from bios.exceptions import BadRequestError, BiosAPIError
from bios.security.limits import QuotaLedger, Quotas
from bios.worker.adapter import AdapterState
from bios.worker.engine import ForwardItem, forward_backward

GOOD = [text_datum("the other tenant's perfectly good batch")]
N = 6


def _rl(tokens: int = N, **extra: list[float]) -> t.Datum:
    inputs = {"target_tokens": t.TensorData(list(range(2, 2 + tokens)), "int64"),
              "logprobs": t.TensorData([-1.0] * tokens, "float32"),
              "advantages": t.TensorData([0.5] * tokens, "float32")}
    inputs.update({key: t.TensorData(value, "float32") for key, value in extra.items()})
    return t.Datum(t.ModelInput.from_ints(list(range(1, 1 + tokens))), inputs)


# One malformed request per rule of the spec: (call, args, the field the error must name).
BAD_REQUESTS = {
    "unknown loss": ("forward_backward", ([_rl()], "mse"), "loss_fn"),
    "config key the loss does not use": ("forward_backward", ([_rl()], "ppo", {"clip_low": 0.9}),
                                         "loss_fn_config.clip_low"),
    "config key of another loss": ("forward_backward", ([_rl()], "cispo", {"beta": 0.1}), "loss_fn_config.beta"),
    "config out of range": ("forward_backward", ([_rl()], "dro", {"beta": -1.0}), "loss_fn_config.beta"),
    "config not finite": ("forward_backward", ([_rl()], "ppo", {"clip_high_threshold": math.inf}),
                          "loss_fn_config.clip_high_threshold"),
    "clip low above high": ("forward_backward", ([_rl()], "ppo", {"clip_low_threshold": 1.5}),
                            "loss_fn_config.clip_low_threshold"),
    "gspo without its mask": ("forward_backward", ([_rl()], "gspo"), "data[0].loss_fn_inputs.sequence_ratio_mask"),
    "mask of the wrong length": ("forward_backward", ([_rl(sequence_ratio_mask=[1.0] * (N + 1))], "dro"),
                                 "data[0].loss_fn_inputs.sequence_ratio_mask"),
    "missing advantages": ("forward_backward", ([text_datum("abc")], "ppo"), "data[0].loss_fn_inputs.logprobs"),
    "NaN advantage": ("forward_backward", ([_rl(advantages=[math.nan] * N)], "importance_sampling"),
                      "data[0].loss_fn_inputs.advantages"),
    "token outside the vocabulary": ("forward", ([t.Datum(t.ModelInput.from_ints([1, 10**6]),
                                                          {"target_tokens": [2, 3], "weights": [1.0, 1.0]})],),
                                     "data[0].model_input"),
    "empty batch": ("forward_backward", ([],), "data"),
    "negative learning rate": ("optim_step", (t.AdamParams(learning_rate=-1.0),), "adam_params.learning_rate"),
    "beta2 of 1": ("optim_step", (t.AdamParams(beta2=1.0),), "adam_params.beta2"),
}


async def _one_cycle(good_tc, bad_tc, call: str, args: tuple) -> tuple[BaseException | None, t.ForwardBackwardOutput]:
    """The good tenant's forward and the bad tenant's request, sent together."""
    good = asyncio.ensure_future(good_tc.forward_async(GOOD))
    try:
        await getattr(bad_tc, f"{call}_async")(*args)
        refused = None
    except BiosAPIError as exc:
        refused = exc
    return refused, await (await good)


def test_a_bad_request_is_refused_at_acceptance_and_fails_no_one_else(ticking_service):
    good_tc = ticking_service.create_lora_training_client(BASE, rank=4, seed=3)
    bad_tc = ticking_service.create_lora_training_client(BASE, rank=4, seed=4)
    alone = good_tc.forward(GOOD).result(60)
    for name, (call, args, field) in BAD_REQUESTS.items():
        refused, together = asyncio.run(_one_cycle(good_tc, bad_tc, call, args))
        assert isinstance(refused, BadRequestError), f"{name}: {refused!r}"
        assert refused.field == field, f"{name}: {refused.field} ({refused.message})"
        assert good_tc.model_id not in refused.message
        assert together.metrics["loss:sum"] == alone.metrics["loss:sum"], name
        np.testing.assert_array_equal(together.loss_fn_outputs[0]["logprobs"].to_numpy(),
                                      alone.loss_fn_outputs[0]["logprobs"].to_numpy())
    # the bad tenant's run is untouched: its next request is served
    assert bad_tc.forward_backward([_rl()], "ppo", {"clip_low_threshold": 0.9}).result(60).metrics["loss:sum"] != 0


def test_a_bad_sample_is_refused_at_acceptance(service):
    sampler = service.create_sampling_client(base_model=BASE)
    with pytest.raises(BadRequestError) as raised:
        sampler.sample(t.ModelInput.from_ints([1, 2]), 1, t.SamplingParams(max_tokens=2, seed=-5)).result(60)
    assert raised.value.field == "sampling_params.seed"


def test_a_failed_creation_leaves_no_run_plan_or_count(service):
    rest = service.create_rest_client()
    before = rest.list_training_runs().result(60)
    status_before = service.cluster_status()
    with pytest.raises(BiosAPIError):
        service.create_lora_training_client("bios/no-such-model", rank=4)
    with pytest.raises(BadRequestError) as raised:
        service.create_lora_training_client(BASE, rank=3)
    assert raised.value.field == "rank"
    after = rest.list_training_runs().result(60)
    assert [r.training_run_id for r in after.training_runs] == [r.training_run_id for r in before.training_runs]
    status = service.cluster_status()
    assert status.runs == status_before.runs
    assert "bios/no-such-model" not in status.plans


def test_an_unseeded_run_on_two_workers_equals_a_seeded_run_on_one(tmp_path, service):
    batch = [text_datum("replicas agree from the first step"), text_datum("a second row for the other worker")]
    params = t.AdamParams(learning_rate=1e-3)
    with bios.LocalCluster(workers=2, cycle_s=0.0, worker_threads=1, state_dir=tmp_path) as cluster, \
            bios.ServiceClient(address=cluster.address) as pair:
        wait_for_workers(pair, 2)
        tc = pair.create_lora_training_client(BASE, rank=4)
        seed = tc.get_info().lora_seed
        assert isinstance(seed, int)
        for future in train_steps(tc, batch, params, 3):
            future.result(120)
        two = saved_adapter(pair, tc)
        log = cluster.log_path("coordinator").read_text()
    assert "diverged" not in log
    tc = service.create_lora_training_client(BASE, rank=4, seed=seed)  # the session's one-worker cluster
    assert tc.get_info().lora_seed == seed
    for future in train_steps(tc, batch, params, 3):
        future.result(120)
    one = saved_adapter(service, tc)
    assert_same_weights(two, one, tol=1e-5)


# ---------------------------------------------------------------------------------------------- agreement

VOCAB = 64
INFO = t.BaseModelInfo(name="agree-llama", local_dir="", arch="llama", vocab_size=VOCAB, max_context_length=32,
                       hidden_size=64, num_layers=2, num_parameters=0)
RUN = "s:train:0"


@pytest.fixture(scope="module")
def admission(tmp_path_factory):
    state = tmp_path_factory.mktemp("admission")
    store = Store(state)
    store.add_session("s", "alice")
    admission = Admission(store, Catalog(store, DirectoryCheckpointStore(state / "checkpoints")),
                          QuotaLedger(Quotas()), PoolPlanner(lambda: []))
    yield admission
    store.close()


@pytest.fixture(scope="module")
def worker_model():
    torch.manual_seed(0)
    model = random_llama(VOCAB).to(torch.float32)
    adapter = AdapterState.create(RUN, model, t.LoraConfig(rank=2, seed=1), device="cpu")
    return model, adapter


def _random_request(rng: random.Random) -> m.ForwardBackward:
    loss_fn = rng.choice([*spec.LOSSES, "mse"])
    loss = spec.LOSSES.get(loss_fn, spec.LOSSES["ppo"])
    data = []
    for _ in range(rng.choice([0, 1, 1, 2])):
        n = rng.choice([1, 3, 5, 40])
        tokens = [rng.choice([1, 5, VOCAB - 1, VOCAB, -1]) if rng.random() < 0.1 else rng.randrange(VOCAB)
                  for _ in range(n)]
        inputs = {}
        for key in (*loss.required_inputs, *loss.optional_inputs):
            if rng.random() < 0.08:
                continue
            length = n if rng.random() < 0.9 else n + rng.choice([-1, 1])
            if key == "target_tokens":
                values = [rng.randrange(VOCAB) if rng.random() < 0.97 else VOCAB for _ in range(length)]
                inputs[key] = t.TensorData(values, "int64")
            else:
                value = rng.choice([1.0, 0.5, -0.3, math.nan]) if rng.random() < 0.05 else rng.uniform(-1.5, 0)
                inputs[key] = t.TensorData([value] * length, "float32")
        data.append(t.Datum(t.ModelInput.from_ints(tokens), inputs))
    keys = list({**loss.defaults, "clip_low": 0.9, "beta": 0.1})
    config = {key: rng.choice([0.0, 0.5, 0.9, 1.1, 2.0, -1.0, math.inf])
              for key in rng.sample(keys, rng.choice([0, 0, 1, 2]))} or None
    return m.ForwardBackward(RUN, 1, data, loss_fn, config)


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_admission_and_the_workers_per_item_check_agree(seed, admission, worker_model):
    """Whatever the coordinator admits, a worker runs (a finite loss); whatever it refuses, a worker refuses."""
    op = _random_request(random.Random(seed))
    run = Run(RUN, "s", "alice", "agree-llama", t.LoraConfig(rank=2, seed=1), status="ready", info=INFO,
              next_seq=1)
    verdict = admission.admit(Submit(b"peer", "alice", op, [b"frame"]), {RUN: run}, {}, {})
    model, adapter = worker_model
    try:
        spec.check_forward(op.data, op.loss_fn, op.loss_fn_config, INFO)  # the worker's per-item check
        outputs = forward_backward(model, [ForwardItem(adapter, op.data, op.loss_fn, op.loss_fn_config, True)])
        worker_error = None
    except BadRequestError as exc:
        worker_error = exc
    if isinstance(verdict, Fresh):
        assert worker_error is None, f"admitted but the worker refused: {worker_error}"
        assert math.isfinite(outputs[0].loss)
    else:
        assert isinstance(verdict, Refused)
        assert worker_error is not None and worker_error.field == verdict.error.field


def test_ids_are_built_and_parsed_in_one_place():
    run = ids.run_id("abc", 3)
    assert ids.ModelId.parse(run) == ids.ModelId("abc", 3, "train")
    assert ids.session_of(ids.sampler_id("abc", 2)) == "abc"
    request = ids.RequestId.parse(ids.request_id(run, 7))
    assert (request.target, request.seq, request.automatic) == (run, 7, False)
    assert ids.is_automatic(ids.automatic_request_id(run, 4)) and ids.target_of(ids.automatic_request_id(run, 4)) == run
    with pytest.raises(BadRequestError):
        ids.ModelId.parse("no-kind-here")


def test_a_failing_custom_loss_gives_its_seq_id_up_and_the_run_goes_on(service):
    tc = service.create_lora_training_client(BASE, rank=4, seed=5)

    def broken(data, logprobs):
        raise ValueError("the user's loss is broken")

    with pytest.raises(ValueError, match="broken"):
        tc.forward_backward_custom(GOOD, broken).result(60)
    after = tc.forward_backward(GOOD).result(60)  # not stuck behind the given-up seq_id
    assert math.isfinite(after.metrics["loss:sum"])
