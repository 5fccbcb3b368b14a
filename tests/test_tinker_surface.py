"""Every public method of the official tinker 0.38 SDK's clients, driven against one keyed Bios cluster.

The methods are enumerated from the installed package, so a method a later SDK adds fails the test until it is
driven here. Each works, or fails with the meaning Bios documents for it (a sampler of a built-in model reports
the model's directory as its base model, so `SamplingClient.get_tokenizer` loads it without the hub). Then the
per-key accounting: usage, audit and sessions are scoped to their key; the admin (the admin key) sees every key's.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import httpx
import huggingface_hub
import pytest
import tinker
from safetensors.numpy import load as load_safetensors
from tinker import types as tt
from tinker.lib.api_future_impl import QueueState

import bios
from bios.gateway.json_wire import builtin_dir
from bios.security.keys import ApiKey, KeyStore

BASE = "bios/tiny-llama"
LR = 1e-2
CLIENTS = (tinker.ServiceClient, tinker.TrainingClient, tinker.SamplingClient, tinker.RestClient, tinker.AdminClient)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # the deprecated methods are driven on purpose


def public_methods(cls: type) -> set[str]:
    return {f"{cls.__name__}.{name}" for name, value in inspect.getmembers(cls)
            if not name.startswith("_") and callable(value)}


def datum(text: str) -> tt.Datum:
    tokens = list(text.encode())
    return tt.Datum(model_input=tt.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


BATCH = [datum("Bios speaks the Tinker wire protocol."), datum("The quick brown fox.")]
BATCH_TOKENS = sum(d.model_input.length for d in BATCH)
PROMPT = tt.ModelInput.from_ints(list(b"The quick"))
GREEDY = tt.SamplingParams(max_tokens=6, temperature=0.0, seed=1)


def drain(coro: Any) -> Any:
    """Run a deprecated `*_async` method: await it, and await again what it returns when that is a future (the
    double await of the training methods)."""
    async def both() -> Any:
        value = await coro
        return await value if inspect.isawaitable(value) else value
    return asyncio.run(both())


class Keyed:
    def __init__(self, cluster: bios.LocalCluster, alice: str, bob: str, admin: str) -> None:
        self.url, self.address, self.state_dir = cluster.http_url, cluster.address, cluster.state_dir
        self.alice, self.bob, self.admin = alice, bob, admin


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    state_dir = tmp_path_factory.mktemp("surface")
    keys, _ = KeyStore.init(state_dir)
    alice, bob = f"tml-{keys.create('alice')}", f"tml-{keys.create('bob')}"
    admin = f"tml-{keys.admin_key()}"
    keys.close()
    with bios.LocalCluster(state_dir=state_dir, http="127.0.0.1:0", worker_threads=1,
                           env={"BIOS_GATEWAY_POLL_S": "2"}) as cluster:
        yield Keyed(cluster, alice, bob, admin)


def neg_ll(logprobs, weights):
    loss = -(logprobs * weights).sum()
    return loss, {"custom/neg_ll:sum": loss}


def test_every_public_method_of_the_tinker_sdk_runs_against_bios(keyed, monkeypatch):
    driven: set[str] = set()

    def did(cls: type, *names: str) -> None:
        driven.update(f"{cls.__name__}.{name}" for name in names)

    svc = tinker.ServiceClient(base_url=keyed.url, api_key=keyed.alice, user_metadata={"team": "surface"},
                               display_name="surface tour", project_id="proj-a")
    S, T, C, R, A = CLIENTS

    # ---- ServiceClient (a worker lists a model once it has loaded it)
    tc = svc.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    assert BASE in [m.model_name for m in svc.get_server_capabilities().supported_models]
    assert BASE in [m.model_name for m in drain(svc.get_server_capabilities_async()).supported_models]
    assert isinstance(svc.get_console_url(), str)
    svc.get_telemetry()
    rest = svc.create_rest_client()
    tc_async = drain(svc.create_lora_training_client_async(base_model=BASE, rank=4, seed=2))
    assert tc_async.model_id != tc.model_id
    handle = svc.create_custom_loss(neg_ll, input_ranks={"logprobs": 1, "weights": 1}).result()
    assert handle.loss_id is not None  # uploaded: the loss runs on the server
    did(S, "get_server_capabilities", "get_server_capabilities_async", "get_console_url", "get_telemetry",
        "create_rest_client", "create_lora_training_client", "create_lora_training_client_async",
        "create_custom_loss")

    # ---- TrainingClient: every step kind, sync and deprecated async
    fwd = tc.forward(BATCH, "cross_entropy").result(60)
    fb = tc.forward_backward(BATCH, "cross_entropy").result(60)
    assert fb.metrics["loss:sum"] == pytest.approx(fwd.metrics["loss:sum"], rel=1e-5)
    custom = tc.forward_backward_custom(BATCH, handle).result(60)
    assert custom.metrics["loss:sum"] == pytest.approx(fwd.metrics["loss:sum"], rel=1e-4)
    tc.optim_step(tt.AdamParams(learning_rate=LR)).result(60)
    drain(tc.forward_async(BATCH, "cross_entropy"))
    drain(tc.forward_backward_async(BATCH, "cross_entropy"))
    drain(tc.forward_backward_custom_async(BATCH, neg_ll_datums))
    drain(tc.optim_step_async(tt.AdamParams(learning_rate=LR)))
    state = tc.save_state("tour-state").result(60).path
    drain(tc.save_state_async("tour-state-2"))
    sampler_path = tc.save_weights_for_sampler("tour-sampler").result(60).path
    drain(tc.save_weights_for_sampler_async("tour-sampler-2"))
    external = tc.save_weights_external("tour-external").result(60).path
    assert external == f"tinker://{tc.model_id}/external_weights/tour-external"
    drain(tc.save_weights_external_async("tour-external-2"))
    assert tc.get_info().model_data.model_name == BASE and drain(tc.get_info_async()).lora_rank == 4
    assert tc.get_tokenizer().decode(list(b"hi")) == "hi"
    assert isinstance(tc.get_console_url(), str)
    tc.get_telemetry()
    tc.load_state(state).result(60)
    drain(tc.load_state_async(state))
    tc.load_state_with_optimizer(state).result(60)
    drain(tc.load_state_with_optimizer_async(state))
    live = tc.save_weights_and_get_sampling_client().result()
    live_async = drain(tc.save_weights_and_get_sampling_client_async())
    named = tc.create_sampling_client(sampler_path)
    named_async = drain(tc.create_sampling_client_async(sampler_path))
    did(T, "forward", "forward_backward", "forward_backward_custom", "optim_step", "forward_async",
        "forward_backward_async", "forward_backward_custom_async", "optim_step_async", "save_state",
        "save_state_async", "save_weights_for_sampler", "save_weights_for_sampler_async", "save_weights_external",
        "save_weights_external_async", "get_info", "get_info_async", "get_tokenizer", "get_console_url",
        "get_telemetry", "load_state", "load_state_async", "load_state_with_optimizer",
        "load_state_with_optimizer_async", "save_weights_and_get_sampling_client",
        "save_weights_and_get_sampling_client_async", "create_sampling_client", "create_sampling_client_async")

    # ---- ServiceClient, from saved state
    resumed = svc.create_training_client_from_state(state).result()
    resumed_opt = svc.create_training_client_from_state_with_optimizer(state).result()
    drain(svc.create_training_client_from_state_async(state))
    drain(svc.create_training_client_from_state_with_optimizer_async(state))
    assert {resumed.model_id, resumed_opt.model_id}.isdisjoint({tc.model_id})
    sc = svc.create_sampling_client(model_path=sampler_path).result()
    sc_async = drain(svc.create_sampling_client_async(model_path=sampler_path))
    copied = svc.copy_weights(sampler_path).result()
    assert copied.endswith("/sampler_weights/tour-sampler") and not copied.startswith(f"tinker://{tc.model_id}/")
    did(S, "create_training_client_from_state", "create_training_client_from_state_with_optimizer",
        "create_training_client_from_state_async", "create_training_client_from_state_with_optimizer_async",
        "create_sampling_client", "create_sampling_client_async", "copy_weights")

    # ---- SamplingClient: every client samples the same adapter the same way
    reference = sc.sample(PROMPT, 1, GREEDY).result(60).sequences[0].tokens
    for client in (named, named_async, sc_async):
        assert client.sample(PROMPT, 1, GREEDY).result(60).sequences[0].tokens == reference
    assert drain(sc.sample_async(PROMPT, 1, GREEDY)).sequences[0].tokens == reference
    for client in (live, live_async):
        assert len(client.sample(PROMPT, 1, GREEDY).result(60).sequences[0].tokens) <= GREEDY.max_tokens
    logprobs = sc.compute_logprobs(PROMPT).result(60)
    assert logprobs[0] is None and len(logprobs) == PROMPT.length
    again = drain(sc.compute_logprobs_async(PROMPT))
    assert again[0] is None and again[1:] == pytest.approx(logprobs[1:], rel=1e-5)  # approx takes numbers only
    assert sc.get_base_model() == builtin_dir(BASE) == drain(sc.get_base_model_async())  # a directory here
    handle_text = sc.get_sampler_handle()
    clone = tinker.SamplingClient.from_sampler_handle(handle_text, api_key=keyed.alice)
    cloned = clone.sample(PROMPT, 1, GREEDY).result(60).sequences[0]
    assert cloned.tokens == reference
    seq_id = int(cloned.sequence_id.rsplit(":", 1)[0].rsplit("#", 1)[1])
    assert seq_id // 1_000_000_000 == 1  # the clone joined the sampling session as its client 1
    created = tinker.SamplingClient.create(svc.holder, model_path=sampler_path).result()
    assert created.sample(PROMPT, 1, GREEDY).result(60).sequences[0].tokens == reference
    sc.on_queue_state_change(QueueState.ACTIVE, None)
    sc.get_telemetry()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no hub here: the directory serves
    assert sc.get_tokenizer().decode(list(b"hi")) == "hi"
    did(C, "sample", "sample_async", "compute_logprobs", "compute_logprobs_async", "get_base_model",
        "get_base_model_async", "get_sampler_handle", "from_sampler_handle", "create", "on_queue_state_change",
        "get_telemetry", "get_tokenizer")

    # ---- RestClient
    session_id = svc.holder.get_session_id()
    assert rest.get_server_capabilities().result().supported_models
    assert tc.model_id in [r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs]
    assert drain(rest.list_training_runs_async(limit=100)).cursor.total_count >= 2
    assert rest.get_training_run(tc.model_id).result().lora_rank == 4
    assert drain(rest.get_training_run_async(tc.model_id)).base_model == BASE
    assert rest.get_training_run_by_tinker_path(state).result().training_run_id == tc.model_id
    assert drain(rest.get_training_run_by_tinker_path_async(state)).training_run_id == tc.model_id
    assert rest.get_weights_info_by_tinker_path(state).result().lora_rank == 4
    listed = {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert {state, sampler_path, external} <= set(listed)
    assert len(drain(rest.list_checkpoints_async(tc.model_id)).checkpoints) == len(listed)
    mine = rest.list_user_checkpoints(limit=1000).result().checkpoints
    assert copied in [c.tinker_path for c in mine]
    assert len(drain(rest.list_user_checkpoints_async(limit=1000)).checkpoints) == len(mine)

    rest.publish_checkpoint_from_tinker_path(sampler_path).result()
    assert _checkpoint(rest, sampler_path).public
    rest.unpublish_checkpoint_from_tinker_path(sampler_path).result()
    assert not _checkpoint(rest, sampler_path).public
    drain(rest.publish_checkpoint_from_tinker_path_async(external))
    drain(rest.unpublish_checkpoint_from_tinker_path_async(external))
    before = datetime.now(timezone.utc)
    rest.set_checkpoint_ttl_from_tinker_path(state, 7200).result()
    expires = _checkpoint(rest, state).expires_at
    assert before + timedelta(seconds=7190) < expires < before + timedelta(seconds=7300)
    drain(rest.set_checkpoint_ttl_from_tinker_path_async(state, None))
    assert _checkpoint(rest, state).expires_at is None
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
        rest.set_checkpoint_ttl_from_tinker_path(state, 5).result()

    urls = rest.get_external_weights_urls(external).result().urls
    assert set(urls) == {"adapter.safetensors", "metadata.json"}
    adapter = load_safetensors(httpx.get(urls["adapter.safetensors"]).raise_for_status().content)  # no key needed
    assert any("lora_A" in key for key in adapter)
    assert drain(rest.get_external_weights_urls_async(external)).urls.keys() == urls.keys()
    assert httpx.get(urls["adapter.safetensors"].replace("sig=", "sig=0")).status_code == 401

    copy2 = rest.copy_weights(state, "proj-c").result()
    copy3 = drain(rest.copy_weights_async(state, "proj-c"))
    assert copy2.endswith("/weights/tour-state") and copy3 != copy2
    rest.delete_checkpoint_from_tinker_path(copy2).result()
    drain(rest.delete_checkpoint_from_tinker_path_async(copy3))
    run2, _, cid = external.removeprefix("tinker://").partition("/")
    rest.delete_checkpoint(run2, cid).result()
    drain(rest.delete_checkpoint_async(run2, "external_weights/tour-external-2"))
    assert external not in {c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints}

    session = rest.get_session(session_id).result()
    assert tc.model_id in session.training_run_ids and session.display_name == "surface tour"
    assert session.user_metadata == {"team": "surface"} and sc.get_sampler_handle() is not None
    assert drain(rest.get_session_async(session_id)).training_run_ids == session.training_run_ids
    assert session_id in rest.list_sessions(limit=100).result().sessions
    assert session_id in drain(rest.list_sessions_async(limit=100)).sessions
    sampler_id = session.sampler_ids[0]
    assert rest.get_sampler(sampler_id).result().base_model == builtin_dir(BASE)
    assert drain(rest.get_sampler_async(sampler_id)).sampler_id == sampler_id
    found = rest.search_sessions(tt.SessionSearchRequest(display_name="SURFACE tour")).result().sessions
    assert [s.session_id for s in found] == [session_id] and found[0].project_id == "proj-a"
    assert found[0].status.type == "active" and found[0].checkpoints_count >= 3
    rest.assign_session_project(session_id, "proj-b").result()
    drain(rest.assign_session_project_async(session_id, "proj-b"))
    in_b = rest.search_sessions(tt.SessionSearchRequest(project_ids=["proj-b"])).result().sessions
    assert [s.session_id for s in in_b] == [session_id]

    trace_url = rest.export_session_trace(session_id).result()
    assert drain(rest.export_session_trace_async(session_id)).startswith(keyed.url)
    trace = httpx.get(trace_url).raise_for_status().json()
    traced = {e["args"]["request_id"].split("#")[0] for e in trace["traceEvents"] if "request_id" in e.get("args", {})}
    assert tc.model_id in traced and traced & set(session.sampler_ids)  # training requests and samples

    who = rest.whoami().result()  # the SDK traded the key for a JWT; its claims name the key
    assert (who.user_urn, who.org_urn, who.email) == (f"bios:key:{_key_id(keyed.alice)}", "tml:organization:bios",
                                                      None)
    rest.get_telemetry()
    day = datetime.now(timezone.utc)
    start, end = _hour(day - timedelta(hours=1)), _hour(day + timedelta(hours=1))
    assert rest.get_billing_usage(start, end).result().data
    assert drain(rest.get_billing_usage_async(start, end)).data
    assert rest.get_audit_log().result().entries
    assert drain(rest.get_audit_log_async()).entries
    assert rest.get_current_checkpoint_storage_usage().result().data
    assert drain(rest.get_current_checkpoint_storage_usage_async()).data
    did(R, "get_server_capabilities", "list_training_runs", "list_training_runs_async", "get_training_run",
        "get_training_run_async", "get_training_run_by_tinker_path", "get_training_run_by_tinker_path_async",
        "get_weights_info_by_tinker_path", "list_checkpoints", "list_checkpoints_async", "list_user_checkpoints",
        "list_user_checkpoints_async", "publish_checkpoint_from_tinker_path",
        "unpublish_checkpoint_from_tinker_path", "publish_checkpoint_from_tinker_path_async",
        "unpublish_checkpoint_from_tinker_path_async", "set_checkpoint_ttl_from_tinker_path",
        "set_checkpoint_ttl_from_tinker_path_async", "get_external_weights_urls", "get_external_weights_urls_async",
        "copy_weights", "copy_weights_async", "delete_checkpoint_from_tinker_path",
        "delete_checkpoint_from_tinker_path_async", "delete_checkpoint", "delete_checkpoint_async", "get_session",
        "get_session_async", "list_sessions", "list_sessions_async", "get_sampler", "get_sampler_async",
        "search_sessions", "assign_session_project", "assign_session_project_async", "export_session_trace",
        "export_session_trace_async", "whoami", "get_telemetry", "get_billing_usage", "get_billing_usage_async",
        "get_audit_log", "get_audit_log_async", "get_current_checkpoint_storage_usage",
        "get_current_checkpoint_storage_usage_async")

    # ---- AdminClient (alice's own records)
    admin_client = tinker.AdminClient(base_url=keyed.url, api_key=keyed.alice)
    admin_client.get_telemetry()
    assert {e.user_id for e in admin_client.get_billing_usage(start, end).result().data} == {_key_id(keyed.alice)}
    assert drain(admin_client.get_billing_usage_async(start, end)).data
    assert admin_client.get_audit_log(event_type="checkpoints").result().entries
    assert drain(admin_client.get_audit_log_async()).entries
    assert admin_client.get_current_checkpoint_storage_usage(project_id="proj-b").result().data
    assert drain(admin_client.get_current_checkpoint_storage_usage_async()).data
    did(A, "get_telemetry", "get_billing_usage", "get_billing_usage_async", "get_audit_log", "get_audit_log_async",
        "get_current_checkpoint_storage_usage", "get_current_checkpoint_storage_usage_async")

    svc.close("success").result()
    did(S, "close")
    own = tinker.RestClient(base_url=keyed.url, api_key=keyed.alice)  # the session's RestClient closed with it
    finished = own.search_sessions(tt.SessionSearchRequest(session_id=session_id)).result().sessions[0]
    assert finished.status.type == "client_finished" and finished.status.reason.type == "success"

    missing = set().union(*(public_methods(cls) for cls in CLIENTS)) - driven
    assert not missing, f"public tinker SDK methods this test does not drive: {sorted(missing)}"


def neg_ll_datums(data, logprobs):
    loss = sum(-(lp * torch_weights(d)).sum() for d, lp in zip(data, logprobs, strict=True))
    return loss, {}


def torch_weights(d: tt.Datum):
    return d.loss_fn_inputs["weights"].to_torch()


def _checkpoint(rest: tinker.RestClient, path: str) -> tt.Checkpoint:
    run = path.removeprefix("tinker://").split("/")[0]
    return next(c for c in rest.list_checkpoints(run).result().checkpoints if c.tinker_path == path)


def _hour(when: datetime) -> str:
    return when.replace(minute=0, second=0, microsecond=0).isoformat().replace("+00:00", "Z")


def _key_id(key: str) -> str:
    return ApiKey.parse(key).key_id


# ------------------------------------------------------------------------------------------ keys scope everything


def _totals(events) -> dict[str, float]:
    totals: dict[str, float] = {}
    for event in events:
        info = event.event_info
        amount = getattr(info, "token_count", None) or getattr(info, "count", None) or info.gigabyte_hours
        totals[info.type] = totals.get(info.type, 0.0) + amount
    return totals


def test_usage_audit_and_sessions_are_scoped_to_their_key(keyed):
    keys = KeyStore.open(keyed.state_dir)
    dave = f"tml-{keys.create('dave')}"  # a key of its own: the counts below are exactly this test's
    keys.close()
    dave_id, alice_id = _key_id(dave), _key_id(keyed.alice)
    with tinker.ServiceClient(base_url=keyed.url, api_key=dave, display_name="dave's") as svc:
        tc = svc.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
        tc.forward_backward(BATCH, "cross_entropy").result(60)
        sampler = tc.save_weights_and_get_sampling_client().result()
        sampled = sampler.sample(PROMPT, 2, GREEDY).result(60).sequences
        dave_session = svc.holder.get_session_id()
    now = datetime.now(timezone.utc)
    start, end = _hour(now - timedelta(hours=1)), _hour(now + timedelta(hours=1))

    mine = tinker.AdminClient(base_url=keyed.url, api_key=dave)
    events = mine.get_billing_usage(start, end).result().data
    assert {e.user_id for e in events} == {dave_id}
    totals = _totals(events)
    assert totals["training"] == BATCH_TOKENS
    assert totals["sampling_prefill"] == PROMPT.length
    assert totals["sampling_sample"] == sum(len(s.tokens) for s in sampled)
    assert totals["checkpoint"] == 1
    checkpoints = tinker.RestClient(base_url=keyed.url, api_key=dave).list_user_checkpoints().result()
    size = sum(c.size_bytes for c in checkpoints.checkpoints)
    elapsed_h = (time.time() - checkpoints.checkpoints[0].time.timestamp()) / 3600
    assert 0 < totals["storage"] <= size / 1e9 * elapsed_h * 1.01 + 1e-12
    assert [(d.org_user_urn, d.size_bytes, d.checkpoint_count) for d in
            mine.get_current_checkpoint_storage_usage().result().data] == [(dave_id, size, 1)]
    audit = mine.get_audit_log().result().entries
    assert {e.event_details["owner"] for e in audit} == {dave_id}
    assert {"api_key_created", "training_run_created"} <= {e.event for e in audit}

    # the native SDK reads the same records
    native = bios.ServiceClient(address=keyed.address, api_key=dave.removeprefix("tml-"))
    try:
        native_rest = native.create_rest_client()
        window = (datetime.fromisoformat(start).timestamp(), datetime.fromisoformat(end).timestamp())
        native_totals: dict[str, float] = {}
        for bucket in native_rest.get_billing_usage(*window).result(60).buckets:
            native_totals[bucket.kind] = native_totals.get(bucket.kind, 0.0) + bucket.quantity
        assert {k: v for k, v in native_totals.items() if k != "storage"} == {
            k: v for k, v in totals.items() if k != "storage"}
        assert [(s.owner, s.checkpoint_count, s.size_bytes) for s in
                native_rest.get_current_checkpoint_storage_usage().result(60).items] == [(dave_id, 1, size)]
        assert {e.event for e in native_rest.get_audit_log().result(60).entries} == {e.event for e in audit}
        path = checkpoints.checkpoints[0].tinker_path
        native_rest.publish_checkpoint(path).result(60)
        assert _checkpoint(tinker.RestClient(base_url=keyed.url, api_key=dave), path).public
        assert native_rest.set_checkpoint_ttl(path, 3600).result(60).expires_at > time.time() + 3500
    finally:
        native.close()

    alice = tinker.AdminClient(base_url=keyed.url, api_key=keyed.alice)
    assert dave_id not in {e.user_id for e in alice.get_billing_usage(start, end).result().data}
    assert dave_id not in {e.event_details["owner"] for e in alice.get_audit_log().result().entries}
    alice_rest = tinker.RestClient(base_url=keyed.url, api_key=keyed.alice)
    everyone = tt.SessionSearchRequest(owner=tt.AccessibleSearchOwner())
    assert dave_session not in {s.session_id for s in alice_rest.search_sessions(everyone).result().sessions}
    with pytest.raises(tinker.NotFoundError):
        alice_rest.get_session(dave_session).result()
    with pytest.raises(tinker.NotFoundError):
        alice_rest.publish_checkpoint_from_tinker_path(checkpoints.checkpoints[0].tinker_path).result()

    admin = tinker.AdminClient(base_url=keyed.url, api_key=keyed.admin)
    assert {dave_id, alice_id} <= {e.user_id for e in admin.get_billing_usage(start, end).result().data}
    assert {dave_id, alice_id} <= {e.event_details["owner"] for e in admin.get_audit_log().result().entries}
    assert {dave_id, alice_id} <= {d.org_user_urn for d in admin.get_current_checkpoint_storage_usage().result().data}
    admin_rest = tinker.RestClient(base_url=keyed.url, api_key=keyed.admin)
    owners = {s.owner for s in admin_rest.search_sessions(everyone).result().sessions}
    assert {dave_id, alice_id} <= owners


# ------------------------------------------------------------------------------------------ routes behind SDK flags, keys


def test_routes_the_sdk_calls_only_behind_flags(keyed, tmp_path):
    with tinker.ServiceClient(base_url=keyed.url, api_key=keyed.bob) as svc:
        tc = svc.create_lora_training_client(base_model=BASE, rank=4, seed=4).result()
        tc.save_weights_and_get_sampling_client().result()
        session = svc.create_rest_client().get_session(svc.holder.get_session_id()).result().sampler_ids[-1]
    bob = httpx.Client(base_url=f"{keyed.url}/api/v1", headers={"X-API-Key": keyed.bob}, timeout=30)
    alice = httpx.Client(base_url=f"{keyed.url}/api/v1", headers={"X-API-Key": keyed.alice}, timeout=30)

    # join_sampling_session: each clone gets a new number; another key's session is not found
    counters = [json_of(bob.post("/join_sampling_session", json={"sampling_session_id": session}))["client_counter"]
                for _ in range(2)]
    assert counters == [1, 2]
    assert alice.post("/join_sampling_session", json={"sampling_session_id": session}).status_code == 404

    # retrieve_futures lists the finished requests of one clone of one sampling session, after the cursor
    def asample(seq_id: int) -> str:
        body = {"sampling_session_id": session, "seq_id": seq_id, "num_samples": 1,
                "prompt": {"chunks": [{"tokens": list(b"Hi"), "type": "encoded_text"}]},
                "sampling_params": {"max_tokens": 2, "temperature": 0.0}}
        return json_of(bob.post("/asample", json=body))["request_id"]

    first, cloned = asample(7), asample(2_000_000_007)
    target = {"type": "sampling_session", "sampling_session_id": session, "cloned_sampler_id": 0}
    polled = json_of(bob.post("/retrieve_futures", json={"target": target, "prev_cursor": 0, "timeout": 20}))
    assert [c["request_id"] for c in polled["completions"]] == [first]
    assert polled["completions"][0]["state"] == "finished"
    again = json_of(bob.post("/retrieve_futures", json={"target": target, "prev_cursor": polled["cursor"],
                                                          "timeout": 0}))
    assert again["completions"] == [] and again["cursor"] == polled["cursor"]
    clone = json_of(bob.post("/retrieve_futures", json={"target": {**target, "cloned_sampler_id": 2},
                                                          "prev_cursor": 0, "timeout": 20}))
    assert [c["request_id"] for c in clone["completions"]] == [cloned]
    assert json_of(alice.post("/retrieve_futures", json={"target": target, "timeout": 0}))["completions"] == []

    # cancel_future: the gateway stops holding a pending request (here one waiting for a missing seq_id)
    waiting = json_of(bob.post("/optim_step", json={"model_id": tc.model_id, "seq_id": 50, "type": "optim_step",
                                                    "adam_params": {"learning_rate": 1e-3}}))["request_id"]
    assert json_of(alice.post("/cancel_future", json={"request_id": waiting})) == {"cancelled": False}
    assert json_of(bob.post("/cancel_future", json={"request_id": waiting})) == {"cancelled": True}
    assert json_of(bob.post("/cancel_future", json={"request_id": waiting})) == {"cancelled": False}  # done once
    # the coordinator still holds the request (Bios does not abort accepted work): asking again re-attaches
    assert json_of(bob.post("/retrieve_future", json={"request_id": waiting}))["type"] == "try_again"

    # auth/apikey/me describes the calling key; DELETE revokes that key only
    me = json_of(bob.get("/auth/apikey/me"))
    assert me["name"] == "bob" and me["key_id"] == int(_key_id(keyed.bob), 16) and me["admin"] is False
    admin = json_of(httpx.get(f"{keyed.url}/api/v1/auth/apikey/me", headers={"X-API-Key": keyed.admin}))
    assert admin["admin"] is True
    keys = KeyStore.open(keyed.state_dir)
    carol = f"tml-{keys.create('carol')}"
    keys.close()
    carol_http = httpx.Client(base_url=f"{keyed.url}/api/v1", headers={"X-API-Key": carol}, timeout=30)
    assert json_of(carol_http.get("/auth/apikey/me"))["name"] == "carol"
    jwt = json_of(carol_http.post("/auth/token", json={}))["jwt"]
    as_jwt = {"X-API-Key": jwt}
    assert json_of(carol_http.get("/auth/apikey/me", headers=as_jwt))["name"] == "carol"
    forged = carol_http.get("/auth/apikey/me", headers={"X-API-Key": jwt[:-4] + "AAAA"})
    assert forged.status_code == 401 and 'error="invalid_token"' in forged.headers["WWW-Authenticate"]
    assert carol_http.delete("/auth/apikey/me").status_code == 200
    assert carol_http.get("/auth/apikey/me").status_code == 401
    assert carol_http.get("/auth/apikey/me", headers=as_jwt).status_code == 401  # its tokens die with it
    events = tinker.AdminClient(base_url=keyed.url, api_key=keyed.admin).get_audit_log().result().entries
    assert {"api_key_created", "api_key_revoked"} <= {e.event for e in events if e.event_details.get("name") == "carol"}

    # a custom loss graph calling anything off the allow-list is refused when it arrives, naming the call
    forbidden = {"session_id": session.split(":")[0], "custom_loss_seq_id": 7, "name": "evil",
                 "inputs": [{"name": "logprobs", "rank": 1}],
                 "graph": {"format": 1, "nodes": [
                     {"op": "placeholder", "name": "logprobs", "target": "logprobs", "args": [], "kwargs": {}},
                     {"op": "call_function", "name": "boom", "target": "os.system", "args": ["ls"], "kwargs": {}},
                     {"op": "output", "name": "output", "target": "output", "args": [], "kwargs": {}}]}}
    reply = bob.post("/create_custom_loss", json=forbidden)
    assert reply.status_code == 400 and "os.system" in reply.json()["detail"]


def json_of(reply: httpx.Response) -> Any:
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_published_checkpoint_is_readable_by_every_key(keyed):
    with tinker.ServiceClient(base_url=keyed.url, api_key=keyed.alice) as alice:
        tc = alice.create_lora_training_client(base_model=BASE, rank=4, seed=9).result()
        tc.forward_backward(BATCH, "cross_entropy").result(60)
        tc.optim_step(tt.AdamParams(learning_rate=LR)).result(60)
        path = tc.save_weights_for_sampler("shared").result(60).path
        state = tc.save_state("shared-state").result(60).path
        theirs = alice.create_sampling_client(model_path=path).result().sample(PROMPT, 1, GREEDY).result(60)
    alice_rest = tinker.RestClient(base_url=keyed.url, api_key=keyed.alice)
    with tinker.ServiceClient(base_url=keyed.url, api_key=keyed.bob, project_id="bobs") as bob:
        with pytest.raises(tinker.NotFoundError):  # private until published
            bob.create_sampling_client(model_path=path).result()
        for published in (path, state):
            alice_rest.publish_checkpoint_from_tinker_path(published).result()
        ours = bob.create_sampling_client(model_path=path).result().sample(PROMPT, 1, GREEDY).result(60)
        assert ours.sequences[0].tokens == theirs.sequences[0].tokens
        assert bob.create_training_client_from_state(state).result().get_info().lora_rank == 4
        copied = bob.copy_weights(path).result()
        bob_rest = tinker.RestClient(base_url=keyed.url, api_key=keyed.bob)
        assert copied in {c.tinker_path for c in bob_rest.list_user_checkpoints().result().checkpoints}
        with pytest.raises(tinker.NotFoundError):  # readable, not the reader's to delete
            bob_rest.delete_checkpoint_from_tinker_path(path).result()
        alice_rest.unpublish_checkpoint_from_tinker_path(path).result()
        with pytest.raises(tinker.NotFoundError):
            bob.create_sampling_client(model_path=path).result()
