"""Backpressure: over a cap a request is refused with a retryable RateLimitError before anything changes, the
SDK resends it by itself, and what the coordinator holds stays bounded."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import zmq
from conftest import BASE, text_datum

import bios
from bios import ids
from bios import messages as m
from bios import types
from bios.coordinator.catalog import Catalog
from bios.coordinator.checkpoints import DirectoryCheckpointStore
from bios.coordinator.runs import queued_tokens
from bios.coordinator.scheduler import Scheduler, Submit
from bios.coordinator.store import Store
from bios.exceptions import BadRequestError, RateLimitError
from bios.sdk import connection
from bios.security.keys import ApiKey, KeyStore
from bios.security.limits import QuotaLedger, Quotas
from bios.transport.codec import Envelope
from bios.transport.sockets import next_message_id
from bios.wire import make_codec

BATCH = [text_datum("tiny")]
QUOTAS = {
    "BIOS_QUOTA_MAX_QUEUED_PER_KEY": "3",
    "BIOS_QUOTA_MAX_QUEUED": "6",
    "BIOS_QUOTA_MAX_SAMPLING_PER_KEY": "2",
    "BIOS_QUOTA_MAX_TOKENS_PER_REQUEST": "64",
    "BIOS_QUOTA_MAX_MESSAGE_BYTES": str(1024 * 1024),
    "BIOS_QUOTA_RETRY_AFTER_S": "0.2",
}


# ---------------------------------------------------------------------------------------------- the ledger


def test_ledger_caps_per_key_and_in_total_and_forgets_finished_work():
    ledger = QuotaLedger(Quotas(max_queued_per_key=2, max_queued=3, max_queued_bytes_per_key=100,
                                max_queued_bytes=150, max_sampling_per_key=1, max_sampling=2, retry_after_s=0.5))
    ledger.check("a", nbytes=10, sampling=False)
    ledger.record("a#1", "a", nbytes=10, sampling=False)
    ledger.record("a#2", "a", nbytes=10, sampling=True)
    with pytest.raises(RateLimitError, match="this key has 2 unfinished") as refused:
        ledger.check("a", nbytes=10, sampling=False)
    assert refused.value.retry_after == 0.5
    ledger.check("b", nbytes=10, sampling=True)  # another key still fits...
    ledger.record("b#1", "b", nbytes=10, sampling=False)
    with pytest.raises(RateLimitError, match="the cluster has 3"):  # ...until the cluster is full
        ledger.check("c", nbytes=1, sampling=False)
    ledger.release("a#1")
    with pytest.raises(RateLimitError, match="sample requests"):
        ledger.check("a", nbytes=1, sampling=True)
    with pytest.raises(RateLimitError, match="MiB"):
        ledger.check("b", nbytes=91, sampling=False)
    ledger.check("b", nbytes=90, sampling=False)
    with pytest.raises(BadRequestError, match="split it") as too_big:
        QuotaLedger(Quotas(max_tokens_per_request=8)).check_tokens(9, "data")
    assert too_big.value.field == "data"
    for request_id in ("a#2", "b#1", "b#1", "unknown"):
        ledger.release(request_id)
    assert not (ledger.tickets or ledger.queued or ledger.queued_bytes or ledger.sampling)
    assert ledger.total_bytes == ledger.total_sampling == 0
    ledger.arrive("a")
    ledger.arrived("a")
    assert not ledger.arriving
    assert ledger.rejected == 4


def test_quotas_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("BIOS_QUOTA_MAX_QUEUED_PER_KEY", "7")
    monkeypatch.setenv("BIOS_QUOTA_RETRY_AFTER_S", "0.25")
    assert Quotas.from_env() == Quotas(max_queued_per_key=7, retry_after_s=0.25)
    monkeypatch.setenv("BIOS_QUOTA_MAX_QUEUED", "many")
    with pytest.raises(ValueError, match="BIOS_QUOTA_MAX_QUEUED must be a number"):
        Quotas.from_env()


async def test_a_runs_next_request_gets_in_even_when_later_ones_fill_the_cap(tmp_path):
    """Requests 2 and 3 were sent after 1; if 2 got in while 1 was refused, 1 must not stay out behind it."""
    store = Store(tmp_path)
    scheduler = Scheduler(store, Catalog(store, DirectoryCheckpointStore(tmp_path / "checkpoints")), make_codec(),
                          _no_push, lambda: None, ledger=QuotaLedger(Quotas(max_queued_per_key=2)))
    store.add_session("s", "a")
    await scheduler.submit(Submit(b"a", "a", m.CreateModel("s", 0, BASE, types.LoraConfig(rank=4)), [b"x"]))
    scheduler.runs["s:train:0"].take_cycle()  # the run is being created: its next request is seq_id 1

    def forward_backward(seq_id: int) -> Submit:
        return Submit(b"a", "a", m.ForwardBackward("s:train:0", seq_id, BATCH, "cross_entropy"), [b"x"])

    await scheduler.submit(forward_backward(2))  # 2 places taken: the creation and seq_id 2
    with pytest.raises(RateLimitError):
        await scheduler.submit(forward_backward(3))
    assert (await scheduler.submit(forward_backward(1))).request_id == "s:train:0#1"  # over the cap, by design
    assert scheduler.ledger.queued["a"] == 3
    with pytest.raises(RateLimitError):  # ...and only the next request is let through
        await scheduler.submit(forward_backward(3))
    store.close()


async def _no_push(peer: bytes, frames: list) -> None:
    pass


# ---------------------------------------------------------------------------------------------- a coordinator


@dataclass
class Capped:
    cluster: bios.LocalCluster
    keys: dict[str, str]
    clients: dict[str, bios.ServiceClient]


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    """A keyed coordinator with tight quotas and, at first, no worker: accepted work stays queued."""
    state_dir = tmp_path_factory.mktemp("capped")
    store, _ = KeyStore.init(state_dir)
    keys = {name: str(store.create(name)) for name in ("alice", "bob", "carol")}
    store.close()
    with bios.LocalCluster(state_dir=state_dir, workers=0, worker_threads=1, env=QUOTAS) as cluster:
        clients = {name: bios.ServiceClient(address=cluster.address, api_key=key) for name, key in keys.items()}
        yield Capped(cluster, keys, clients)
        for client in clients.values():
            client.close()


def _forward_backward(client: bios.ServiceClient, seq_id: int, data=BATCH):
    """Submit straight to run 0 of the client's session, which need not exist on a worker yet."""
    op = m.ForwardBackward(ids.run_id(client.session_id, 0), seq_id, data, "cross_entropy")
    return client._conn.submit(op, ids.request_id_of(op))


def test_full_queues_refuse_with_retry_after_then_accept_the_same_request(capped, monkeypatch):
    monkeypatch.setattr(connection, "RATE_LIMIT_RETRIES", 0)  # see each refusal instead of the SDK's resends
    alice, bob, carol = (capped.clients[name] for name in ("alice", "bob", "carol"))
    created = alice._create(BASE, types.LoraConfig(rank=4, seed=1))  # accepted now, created when a worker comes

    accepted, _ = _forward_backward(alice, 1, [text_datum("x" * 80)])  # more tokens than a request may carry:
    with pytest.raises(BadRequestError, match="split it"):  # refused for good, no retry can help
        accepted.result(30)
    queued = [_forward_backward(alice, seq) for seq in (2, 3)]
    for accepted, _ in queued:
        accepted.result(30)
    over, over_result = _forward_backward(alice, 4)  # alice's 4th unfinished request: over her cap of 3
    with pytest.raises(RateLimitError, match="this key has 3 unfinished") as refused:
        over.result(30)
    assert refused.value.retry_after == pytest.approx(0.2)
    with pytest.raises(RateLimitError):
        over_result.result(30)

    sampler = bob.create_sampling_client(base_model=BASE)
    prompt = types.ModelInput.from_ints([1, 2, 3])
    samples = [sampler.sample(prompt, sampling_params=types.SamplingParams(max_tokens=2)) for _ in range(3)]
    for sample in samples[:2]:
        sample._accepted.result(30)
    with pytest.raises(RateLimitError, match="sample requests in progress"):  # bob's cap on concurrent sampling
        samples[2]._accepted.result(30)
    bob._create(BASE, types.LoraConfig(rank=4, seed=1))._accepted.result(30)
    with pytest.raises(RateLimitError, match="the cluster has 6"):  # 3 of alice + 3 of bob: the cluster is full
        carol._create(BASE, types.LoraConfig(rank=4, seed=1))._accepted.result(30)

    # a worker arrives: everything queued runs and frees its place; the refused seq_id 4 is still free
    capped.cluster.add_worker()
    assert created.result(120).model_id == f"{alice.session_id}:train:0"
    for _, result in queued:
        assert result.result(120).loss > 0
    for sample in samples[:2]:
        assert len(sample.result(120).sequences) == 1
    accepted, result = _forward_backward(alice, 4)
    accepted.result(30)
    assert result.result(120).loss > 0
    assert alice.cluster_status().queue_depth == 0


def test_the_sdk_resends_refused_requests_by_itself(capped):
    alice = capped.clients["alice"]
    tc = alice.create_lora_training_client(BASE, rank=4, seed=2)
    resent_before = alice._conn.rate_limited
    futures = [tc.forward_backward(BATCH) for _ in range(8)]  # more than alice may queue at once
    futures.append(tc.optim_step(types.AdamParams(learning_rate=1e-3)))
    results = [f.result(120) for f in futures]
    assert all(r.loss > 0 for r in results[:8]) and results[8].learning_rate == pytest.approx(1e-3)
    assert alice._conn.rate_limited > resent_before  # some were refused, resent, and then ran in order


def test_an_oversized_message_is_dropped_and_the_coordinator_serves_on(capped):
    security = ApiKey.parse(capped.keys["alice"]).client_security()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.curve_publickey, sock.curve_secretkey = security.public_key, security.secret_key
    sock.curve_serverkey = security.server_public_key
    sock.connect(capped.cluster.address)
    header = bytes(make_codec().encode(Envelope(next_message_id(), m.Ping()))[0])
    sock.send_multipart([header, bytes(2 * 1024 * 1024)])  # twice the client message limit of this coordinator
    assert sock.poll(1000) == 0  # no answer: the transport dropped it before decoding anything
    sock.close(linger=0)
    ctx.term()
    assert capped.clients["bob"].cluster_status().workers
    assert capped.clients["carol"].create_rest_client().list_training_runs().result().cursor.total_count == 0


async def test_a_refused_request_whose_size_is_unknown_is_not_counted_as_work(tmp_path):
    """Placement weighs each model's queued tokens; a refused request keeps its seq_id's place in the queue but
    is no work, and an image without expected_tokens has no length to count (it once failed the placement)."""
    store = Store(tmp_path)
    scheduler = Scheduler(store, Catalog(store, DirectoryCheckpointStore(tmp_path / "checkpoints")), make_codec(),
                          _no_push, lambda: None)
    store.add_session("s", "a")
    await scheduler.submit(Submit(b"a", "a", m.CreateModel("s", 0, BASE, types.LoraConfig(rank=4)), [b"x"]))
    image = types.ModelInput(chunks=[types.ImageChunk(data=b"not a png", format="png")])
    bad = types.Datum(image, {"target_tokens": [1], "weights": [1.0]})
    with pytest.raises(BadRequestError):
        await scheduler.submit(Submit(b"a", "a", m.ForwardBackward("s:train:0", 1, [bad], "cross_entropy"), [b"x"]))
    assert queued_tokens(scheduler.runs.values()) == {BASE: 0}
    store.close()
