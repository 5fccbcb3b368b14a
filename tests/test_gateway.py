"""The official `tinker` SDK against a Bios cluster through the HTTP gateway: same numbers as the native SDK,
checkpoints, sampling and listings; and raw HTTP misuse answered with a 4xx body while the server keeps serving.
"""

from __future__ import annotations

import asyncio
import sqlite3

import httpx
import numpy as np
import pytest
import tinker
import torch
from aiohttp.test_utils import TestClient, TestServer
from conftest import BASE
from tinker import types as tt
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

import bios
from bios import messages as bm
from bios import types as bt
from bios.exceptions import RateLimitError, RemoteError
from bios.gateway import json_wire, proto
from bios.coordinator.watchdog import NO_WORKER
from bios.gateway.futures import NOTICE_FRESH_S, Promises, json_reply
from bios.gateway.http_io import error_response
from bios.gateway.server import Gateway, GatewayConfig

KEY = "tml-test"
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Bios speaks the Tinker wire protocol."]
LR = 1e-2


@pytest.fixture(scope="module")
def cluster():
    # A short long-poll and gap timeout keep the misuse tests quick; the SDK re-polls on try_again.
    env = {"BIOS_GATEWAY_POLL_S": "2", "BIOS_SEQ_GAP_S": "3"}
    with bios.LocalCluster(http="127.0.0.1:0", env=env) as c:
        yield c


@pytest.fixture(scope="module")
def tinker_service(cluster):
    with tinker.ServiceClient(base_url=cluster.http_url, api_key=KEY) as client:
        yield client


@pytest.fixture(scope="module")
def native_service(cluster):
    client = bios.ServiceClient(address=cluster.address)
    yield client
    client.close()


@pytest.fixture
def http(cluster):
    with httpx.Client(base_url=f"{cluster.http_url}/api/v1", headers={"X-API-Key": KEY}, timeout=30) as client:
        yield client


def _tokens(text: str) -> list[int]:
    return list(text.encode())


def _inputs(text: str, loss_fn: str) -> tuple[list[int], dict[str, list[float] | list[int]]]:
    tokens = _tokens(text)
    n = len(tokens) - 1
    inputs: dict[str, list[float] | list[int]] = {"target_tokens": tokens[1:]}
    if loss_fn == "cross_entropy":
        inputs["weights"] = [1.0] * n
    else:
        inputs["logprobs"] = [-5.0] * n
        inputs["advantages"] = [1.0 if i % 3 else -0.5 for i in range(n)]
    return tokens[:-1], inputs


def tinker_batch(loss_fn: str) -> list[tt.Datum]:
    return [tt.Datum(model_input=tt.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)
            for tokens, inputs in (_inputs(text, loss_fn) for text in TEXTS)]


def native_batch(loss_fn: str) -> list[bt.Datum]:
    return [bt.Datum(bt.ModelInput.from_ints(tokens), inputs)
            for tokens, inputs in (_inputs(text, loss_fn) for text in TEXTS)]


def logprobs_of(out) -> list[np.ndarray]:
    return [np.asarray(record["logprobs"].tolist(), dtype=np.float32) for record in out.loss_fn_outputs]


def assert_tinker_metric_keys(metrics: dict[str, float]) -> None:
    assert "loss:sum" in metrics
    assert all(key.count(":") == 1 for key in metrics), metrics


# ------------------------------------------------------------------------------------------ the SDK flow


STEPS = [("cross_entropy", None), ("importance_sampling", None), ("ppo", {"clip_low_threshold": 0.9}),
         ("stable_reinforce", {"kl_coeff": 0.05}), ("cispo", None)]


def test_training_through_the_gateway_equals_the_native_sdk(tinker_service, native_service):
    tc = tinker_service.create_lora_training_client(base_model=BASE, rank=8, seed=5).result()
    nc = native_service.create_lora_training_client(BASE, rank=8, seed=5)
    assert tc.model_id.startswith(f"{tinker_service.holder.get_session_id()}:train:")
    for loss_fn, config in STEPS:
        fwd = tc.forward_backward(tinker_batch(loss_fn), loss_fn, config)
        opt = tc.optim_step(tt.AdamParams(learning_rate=LR))
        # Each client's step done before the other's starts: another adapter's rows in the same pass can change
        # how the pass is packed and split, and so the rounding (~1e-7), which Adam steps grow past 1e-5
        out, opt_metrics = fwd.result(60), opt.result(60).metrics
        native_fwd = nc.forward_backward(native_batch(loss_fn), loss_fn, config).result(60)
        native_opt = nc.optim_step(bt.AdamParams(learning_rate=LR)).result(60)
        assert_tinker_metric_keys(out.metrics)
        assert out.metrics["loss:sum"] == pytest.approx(native_fwd.loss, rel=1e-5), loss_fn
        for ours, theirs in zip(logprobs_of(out), logprobs_of(native_fwd), strict=True):
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
        assert opt_metrics == pytest.approx(native_opt.metrics, rel=1e-5)
    final = tc.forward(tinker_batch("cross_entropy"), "cross_entropy").result(60)
    native_final = nc.forward(native_batch("cross_entropy"), "cross_entropy").result(60)
    assert final.metrics["loss:sum"] == pytest.approx(native_final.loss, rel=1e-5)
    info = tc.get_info()
    assert info.model_data.model_name == BASE and info.lora_rank == 8
    assert tc.get_tokenizer().decode(_tokens("hi")) == "hi"  # tokenizer_id is the model's local directory


def _weighted_logprob_loss(data, logprobs):
    """A loss the server cannot compute: squared log-probs, weighted per position."""
    loss = sum((torch.linspace(0.5, 1.5, len(lp)) * lp.square()).sum() for lp in logprobs)
    return loss, {"tokens:sum": float(sum(len(lp) for lp in logprobs))}


def test_forward_backward_custom_equals_the_native_sdk(tinker_service, native_service):
    tc = tinker_service.create_lora_training_client(base_model=BASE, rank=8, seed=6).result()
    nc = native_service.create_lora_training_client(BASE, rank=8, seed=6)
    out = tc.forward_backward_custom(tinker_batch("cross_entropy"), _weighted_logprob_loss).result(60)
    tc.optim_step(tt.AdamParams(learning_rate=LR)).result(60)
    native_out = nc.forward_backward_custom(native_batch("cross_entropy"), _weighted_logprob_loss).result(60)
    nc.optim_step(bt.AdamParams(learning_rate=LR)).result(60)
    assert_tinker_metric_keys(out.metrics)
    for key in ("loss:sum", "surrogate_loss:sum", "tokens:sum"):
        assert out.metrics[key] == pytest.approx(native_out.metrics[key], rel=1e-5), key
    after = tc.forward(tinker_batch("cross_entropy"), "cross_entropy").result(60)
    native_after = nc.forward(native_batch("cross_entropy"), "cross_entropy").result(60)
    assert after.metrics["loss:sum"] == pytest.approx(native_after.loss, rel=1e-5)


def test_checkpoints_sampling_and_resume(tinker_service, native_service):
    tc = tinker_service.create_lora_training_client(base_model=BASE, rank=8, seed=7).result()
    for _ in range(2):
        tc.forward_backward(tinker_batch("cross_entropy"), "cross_entropy")
        tc.optim_step(tt.AdamParams(learning_rate=LR))
    saved = tc.save_state("gw-state").result(60)
    assert saved.path == f"tinker://{tc.model_id}/weights/gw-state"

    # Resume exactly: the next step of the original and of the restored run give the same loss.
    resumed = tinker_service.create_training_client_from_state_with_optimizer(saved.path).result()
    assert resumed.model_id != tc.model_id
    for client in (tc, resumed):
        client.forward_backward(tinker_batch("cross_entropy"), "cross_entropy")
        client.optim_step(tt.AdamParams(learning_rate=LR))
    losses = [c.forward(tinker_batch("cross_entropy"), "cross_entropy").result(60).metrics["loss:sum"]
              for c in (tc, resumed)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)

    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = tt.ModelInput.from_ints(_tokens("The quick"))
    greedy = tt.SamplingParams(max_tokens=12, temperature=0.0, seed=1)
    free = sampler.sample(prompt, 1, greedy).result(60).sequences[0]
    assert len(free.tokens) == len(free.logprobs) <= 12 and all(lp <= 0 for lp in free.logprobs)
    assert free.stop_reason == ("length" if len(free.tokens) == 12 else "stop")

    # The same adapter sampled natively gives the same tokens and logprobs.
    path = tc.save_weights_for_sampler("gw-sampler").result(60).path
    assert path == f"tinker://{tc.model_id}/sampler_weights/gw-sampler"
    native = native_service.create_sampling_client(model_path=path).sample(
        bt.ModelInput.from_ints(_tokens("The quick")), 1, bt.SamplingParams(max_tokens=12, temperature=0.0, seed=1)
    ).result(60).sequences[0]
    assert native.tokens == list(free.tokens)
    np.testing.assert_allclose(native.logprobs, free.logprobs, rtol=1e-5, atol=1e-6)

    # A stop string taken from the free-running text ends the samples right after it.
    first_char = next(i for i, token in enumerate(free.tokens) if 32 <= token < 127)
    stop = chr(free.tokens[first_char])
    stopped = sampler.sample(prompt, 2, tt.SamplingParams(max_tokens=12, temperature=0.0, seed=1, stop=[stop]))
    sequences = stopped.result(60).sequences
    assert len(sequences) == 2 and len({seq.sequence_id for seq in sequences}) == 2
    for seq in sequences:
        assert seq.stop_reason == "stop" and list(seq.tokens) == list(free.tokens[: first_char + 1])
        assert len(seq.logprobs) == len(seq.tokens)

    # A named sampler checkpoint opens its own sampling client; prompt logprobs come back with None first.
    scored = tinker_service.create_sampling_client(model_path=path).result()
    assert scored.get_base_model() == json_wire.builtin_dir(BASE)  # a built-in is reported as its directory
    logprobs = scored.compute_logprobs(prompt).result(60)
    assert logprobs[0] is None and len(logprobs) == prompt.length
    assert all(lp is not None and lp <= 0 for lp in logprobs[1:])


def test_rest_listings(cluster, tinker_service):
    tc = tinker_service.create_lora_training_client(base_model=BASE, rank=4, seed=8).result()
    tc.forward_backward(tinker_batch("cross_entropy"), "cross_entropy")
    tc.optim_step(tt.AdamParams(learning_rate=LR))
    kept = tc.save_state("kept").result(60).path
    dropped = tc.save_weights_for_sampler("dropped").result(60).path
    rest = tinker.RestClient(base_url=cluster.http_url, api_key=KEY)

    runs = rest.list_training_runs(limit=100).result()
    assert tc.model_id in [r.training_run_id for r in runs.training_runs]
    assert runs.cursor.total_count >= len(runs.training_runs)
    run = rest.get_training_run(tc.model_id).result()
    assert run.base_model == BASE and run.lora_rank == 4 and run.last_checkpoint.tinker_path == kept
    listed = {c.checkpoint_id: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert listed["weights/kept"].tinker_path == kept and listed["weights/kept"].checkpoint_type == "training"
    assert listed["sampler_weights/dropped"].checkpoint_type == "sampler"
    assert rest.get_weights_info_by_tinker_path(kept).result().lora_rank == 4
    assert kept in [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints]
    session = rest.get_session(tinker_service.holder.get_session_id()).result()
    assert tc.model_id in session.training_run_ids

    rest.delete_checkpoint_from_tinker_path(dropped).result()
    remaining = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert "sampler_weights/dropped" not in [c.checkpoint_id for c in remaining]
    assert BASE in [m.model_name for m in rest.get_server_capabilities().result().supported_models]


# ------------------------------------------------------------------------------------------ raw HTTP


def _fb_body(model_id: str, seq_id: int, loss_fn_config=None) -> bytes:
    request = tt.ForwardBackwardRequest(
        forward_backward_input=tt.ForwardBackwardInput(data=tinker_batch("cross_entropy"), loss_fn="cross_entropy",
                                                       loss_fn_config=loss_fn_config),
        model_id=model_id, seq_id=seq_id)
    return forward_backward_request_to_proto(request).SerializeToString()


def _post_fb(http: httpx.Client, body: bytes) -> httpx.Response:
    return http.post("/forward_backward", content=body, headers={"Content-Type": "application/x-protobuf"})


def _retrieve(http: httpx.Client, request_id: str) -> httpx.Response:
    """Poll like the SDK: again at once on try_again, until a result or an error."""
    for _ in range(30):
        reply = http.post("/retrieve_future", json={"request_id": request_id, "allow_metadata_only": False},
                          headers={"Accept": "application/x-protobuf"})
        if reply.headers["content-type"].startswith("application/json") and reply.json().get("type") == "try_again":
            continue
        return reply
    raise AssertionError(f"{request_id} never finished")


def _json_error(reply: httpx.Response, status: int) -> str:
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"].startswith("application/json")
    return reply.json()["detail"]


@pytest.fixture
def raw_model(tinker_service):
    """A run created with the SDK, driven by hand from seq_id 1."""
    return tinker_service.create_lora_training_client(base_model=BASE, rank=4, seed=9).result().model_id


def test_misuse_gets_a_4xx_with_a_body(cluster, http, raw_model):
    assert "X-API-Key" in _json_error(httpx.post(f"{cluster.http_url}/api/v1/get_info", json={}), 401)
    assert _json_error(http.get("/no_such_route"), 404)
    assert "protobuf" in _json_error(
        http.post("/forward_backward", json={"model_id": raw_model, "seq_id": 1}), 415)
    assert "not a tinker_public.ForwardBackwardRequest" in _json_error(_post_fb(http, b"\xff\x00garbage\x12"), 400)
    assert "no training run" in _json_error(_post_fb(http, _fb_body("nosuch:train:0", 1)), 404)
    assert "not valid JSON" in _json_error(
        http.post("/optim_step", content=b"{", headers={"Content-Type": "application/json"}), 400)
    assert _json_error(http.post("/optim_step", json={"model_id": raw_model, "seq_id": 1,
                                                     "adam_params": {"learning_rate": "fast"}}), 400)
    assert "no request" in _json_error(http.post("/retrieve_future", json={"request_id": "nope#1"}), 404)
    # seq_id 1 was refused above; the run moved past it, so seq_id 2 runs.
    promise = _post_fb(http, _fb_body(raw_model, 2)).json()
    result = deserialize_forward_backward_output(_retrieve(http, promise["request_id"]).content)
    assert result.metrics["loss:sum"] > 0 and http.get("/healthz").json() == {"status": "ok"}


def test_requests_sent_out_of_order_run_in_seq_order_and_resubmits_are_answered(http, raw_model):
    def optim_step() -> httpx.Response:
        return http.post("/optim_step", json={"model_id": raw_model, "seq_id": 2, "adam_params": {"learning_rate": LR}})

    after = _post_fb(http, _fb_body(raw_model, 3)).json()  # arrives first, waits for seq_ids 1 and 2
    step = optim_step().json()
    before = _post_fb(http, _fb_body(raw_model, 1)).json()
    outs = [deserialize_forward_backward_output(_retrieve(http, p["request_id"]).content) for p in (before, after)]
    stepped = _retrieve(http, step["request_id"]).json()
    assert stepped["metrics"]["step:max"] == 1
    assert stepped["metrics"]["grad_norm:mean"] == pytest.approx(outs[0].metrics["grad_norm:max"], rel=1e-5)
    assert outs[1].metrics["loss:sum"] < outs[0].metrics["loss:sum"]  # seq_id 3 saw the step, not the old weights
    again = optim_step().json()
    assert again["request_id"] == step["request_id"]
    assert _retrieve(http, again["request_id"]).json() == stepped  # answered from the stored result, not re-run


def test_a_seq_gap_that_never_fills_fails_in_bounded_time(http, raw_model, tinker_service):
    early = _post_fb(http, _fb_body(raw_model, 3)).json()  # seq_ids 1 and 2 never come
    failed = _retrieve(http, early["request_id"]).json()
    assert failed["category"] == "user" and "seq_id 1 never arrived" in failed["error"]
    # The server keeps serving: a fresh run trains normally.
    tc = tinker_service.create_lora_training_client(base_model=BASE, rank=4, seed=10).result()
    assert tc.forward(tinker_batch("cross_entropy"), "cross_entropy").result(60).metrics["loss:sum"] > 0


def test_a_text_loss_config_is_refused_without_blocking_the_run(http, raw_model):
    refused = _post_fb(http, _fb_body(raw_model, 1, {"kl_coeff": "high"}))
    assert "no Bios loss takes text" in _json_error(refused, 400)
    promise = _post_fb(http, _fb_body(raw_model, 2)).json()
    assert deserialize_forward_backward_output(_retrieve(http, promise["request_id"]).content).metrics["loss:sum"] > 0


def test_asample_promises_carry_one_sequence_id_per_sample(http):
    session_id = http.post("/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "raw"}).json()
    sampler = http.post("/create_sampling_session", json={"session_id": session_id["session_id"],
                                                         "sampling_session_seq_id": 0, "base_model": BASE}).json()
    assert http.get(f"/samplers/{sampler['sampling_session_id']}").json()["base_model"] == json_wire.builtin_dir(BASE)
    body = {"sampling_session_id": sampler["sampling_session_id"], "seq_id": 0, "num_samples": 3,
            "prompt": {"chunks": [{"tokens": _tokens("Hi"), "type": "encoded_text"}]},
            "sampling_params": {"max_tokens": 4, "temperature": 1.0, "top_k": -1, "top_p": 1.0, "seed": 3},
            "prompt_logprobs": False, "type": "sample"}
    promise = http.post("/asample", json=body).json()
    assert len(promise["sample_sequence_ids"]) == 3 and len(set(promise["sample_sequence_ids"])) == 3
    reply = _retrieve(http, promise["request_id"])
    assert reply.headers["content-type"] == "application/x-protobuf"
    assert len(deserialize_sample_response(reply.content).sequences) == 3
    too_many = http.post("/asample", json={**body, "seq_id": 1, "topk_sample_logprobs": 65})  # (1..64 are served)
    assert "topk_sample_logprobs" in _json_error(too_many, 400)



def test_capabilities_carry_the_cycle_length(http):
    """Bios's own field beside the tinker ones: a step waits for the coordinator's next tick."""
    assert http.get("/get_server_capabilities").json()["cycle_s"] == 0.0

# ------------------------------------------------------------------------------------------ pieces


def test_metric_keys_get_exactly_one_colon_and_a_known_reduction():
    assert json_wire.tinker_metrics({"loss:sum": 1.0, "grad_norm:max": 2.0, "loss": 3.0, "a:b:min": 4.0,
                                     "odd:median": 5.0}) == {
        "loss:sum": 1.0, "grad_norm:max": 2.0, "loss:mean": 3.0, "a_b:min": 4.0, "odd_median:mean": 5.0}


async def test_backpressure_is_a_429_with_retry_after():
    class NeverSubmitted:  # a front door the gateway never submits to (it refuses first) and a keyless cluster
        keys = labels = audit = None  # no route that reads them is called
        db = sqlite3.connect(":memory:")  # where uploaded custom losses would go

        def attach(self, name, on_done):
            return b"gateway"

        def authenticate(self, api_key):
            return "local"

        def is_active(self, owner):
            return True

    never = NeverSubmitted()
    gateway = Gateway(never, never, GatewayConfig(max_pending=0))  # full from the start
    body = {"sampling_session_id": "s:sample:0", "seq_id": 0, "num_samples": 1,
            "prompt": {"chunks": [{"tokens": [1, 2], "type": "encoded_text"}]}, "sampling_params": {"max_tokens": 1}}
    async with TestClient(TestServer(gateway.application())) as client:
        reply = await client.post("/api/v1/asample", json=body, headers={"X-API-Key": KEY})
        assert reply.status == 429 and reply.headers["Retry-After"] == "1"
        assert "unfinished requests" in (await reply.json())["detail"]
    rounded = error_response(RateLimitError("queue full", retry_after=2.5))
    assert rounded.status == 429 and rounded.headers["Retry-After"] == "3"


def test_protobuf_results_decode_with_the_sdk():
    outputs = [{"logprobs": bt.TensorData(np.array([-1.0, -2.5], np.float32), "float32")},
               {"logprobs": bt.TensorData(np.array([-0.5], np.float32), "float32")}]
    out = bt.ForwardBackwardOutput("ArrayRecord", outputs, {"loss:sum": 4.0})
    decoded = deserialize_forward_backward_output(proto.forward_backward_output(out, out.metrics))
    assert [r["logprobs"].tolist() for r in decoded.loss_fn_outputs] == [[-1.0, -2.5], [-0.5]]
    assert decoded.metrics == {"loss:sum": 4.0}

    sample = bt.SampleResponse([bt.SampledSequence("stop", [5, 6], [-0.1, -0.2])], [None, -1.0, -2.0, -3.0])
    decoded_sample = deserialize_sample_response(proto.sample_response(sample, prompt_logprobs_last_n=2))
    assert decoded_sample.sequences[0].tokens == [5, 6] and decoded_sample.sequences[0].stop_reason == "stop"
    assert decoded_sample.prompt_logprobs == [None, None, -2.0, -3.0]


def test_forward_backward_protobuf_becomes_the_native_op():
    msg = proto.decode_forward_backward(_fb_body("s:train:0", 4, {"beta": 0.5}))
    op = proto.forward_backward_op(msg)
    assert (op.model_id, op.seq_id, op.loss_fn, op.loss_fn_config) == ("s:train:0", 4, "cross_entropy", {"beta": 0.5})
    tokens, inputs = _inputs(TEXTS[0], "cross_entropy")
    assert op.data[0].model_input.to_ints() == tokens
    assert op.data[0].loss_fn_inputs["target_tokens"].tolist() == inputs["target_tokens"]
    assert op.data[0].loss_fn_inputs["weights"].to_numpy().dtype == np.float32


async def test_a_poll_answers_when_the_result_comes_or_gives_up_after_its_time():
    promises = Promises(keep_served_s=60, keep_unclaimed_s=60)

    async def render(result):
        return json_reply({"echo": result})

    promises.expect("r#1", "alice", render)
    assert await promises.wait("r#1", "alice", 0.01) is None and promises.pending() == 1  # answered try_again
    waiting = asyncio.ensure_future(promises.wait("r#1", "alice", 30))
    promises.deliver(bm.RequestDone("r#1", result=7))
    assert (await waiting).body == b'{"echo": 7}' and promises.pending() == 0
    for request_id, owner in (("unknown#1", "alice"), ("r#1", "mallory")):
        with pytest.raises(KeyError):
            await promises.wait(request_id, owner, 0.01)

    promises.expect("r#2", "alice", render)
    promises.fail("r#2", RemoteError("BadRequestError", "gap"))
    assert b"gap" in (await promises.wait("r#2", "alice", 1)).body
    promises.expect("r#2", "alice", render)  # resent after a failure: the coordinator answers it afresh
    assert await promises.wait("r#2", "alice", 0.01) is None


def test_a_pending_promise_says_why_it_waits_while_the_reason_is_fresh():
    promises = Promises(keep_served_s=60, keep_unclaimed_s=60)

    async def render(result):
        return json_reply(result)

    promises.expect("r#1", "alice", render)
    assert promises.waiting_reason("r#1") is None  # nothing said: the queue is active
    promises.deliver(bm.Notice("r#1", NO_WORKER))
    assert promises.waiting_reason("r#1") == NO_WORKER
    promises._promises["r#1"].notice_at -= NOTICE_FRESH_S + 1  # not repeated since: the worker may be back
    assert promises.waiting_reason("r#1") is None
    promises.deliver(bm.Notice("r#1", NO_WORKER))
    promises.settle("r#1", json_reply(1))
    assert promises.waiting_reason("r#1") is None and promises.waiting_reason("unknown#1") is None


def test_failures_carry_the_user_category():
    assert json_wire.failure(RemoteError("BadRequestError", "bad", field="seq_id")) == {
        "error": "bad (field: seq_id)", "category": "user"}
    assert json_wire.failure(RemoteError("InternalServerError", "boom"))["category"] == "server"
