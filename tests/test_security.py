"""Keys, encryption and isolation: nobody gets in without a key, and nobody sees another key's work.

One keyed cluster (a coordinator and one worker on loopback, CurveZMQ on both sockets) serves the module.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from conftest import BASE, text_datum

import bios
from bios import messages as m
from bios import types
from bios.cli.main import main as bios_cli
from bios.coordinator.catalog import Catalog
from bios.coordinator.checkpoints import DirectoryCheckpointStore
from bios.coordinator.scheduler import Scheduler, Submit
from bios.coordinator.accounts import LOCAL_OWNER
from bios.coordinator.config import CoordinatorConfig
from bios.coordinator.server import Coordinator
from bios.coordinator.store import Store
from bios.exceptions import AuthenticationError, NotFoundError
from bios.security.keys import ApiKey, KeyStore, WorkerToken
from bios.security.listen import InsecureListenError, check_listen, is_local_address
from bios.transport.codec import Envelope
from bios.wire import make_codec
from bios.worker.daemon import WorkerConfig, WorkerDaemon

BATCH = [text_datum("keys keep the data apart")]


@dataclass
class Keyed:
    cluster: bios.LocalCluster
    keys: KeyStore
    alice: str
    bob: str


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    state_dir = tmp_path_factory.mktemp("keyed")
    keys, created = KeyStore.init(state_dir)
    assert created
    alice, bob = str(keys.create("alice")), str(keys.create("bob"))
    with bios.LocalCluster(state_dir=state_dir, worker_threads=1) as cluster:
        yield Keyed(cluster, keys, alice, bob)
    keys.close()


@pytest.fixture
def no_env_key(monkeypatch):
    monkeypatch.delenv("BIOS_API_KEY", raising=False)


def _client(keyed: Keyed, key: str | None) -> bios.ServiceClient:
    return bios.ServiceClient(address=keyed.cluster.address, api_key=key, connect_timeout_s=20)


# ---------------------------------------------------------------------------------------------- keys


def test_key_strings_round_trip_and_only_hashes_are_stored(tmp_path):
    keys, _ = KeyStore.init(tmp_path)
    key = keys.create("carol")
    text = str(key)
    assert text.startswith("bios_") and ApiKey.parse(text) == key
    assert ApiKey.parse("tml-" + text) == key  # as the Tinker SDK sends it
    assert keys.authenticate(text) == key.key_id == keys.authenticate("tml-" + text)
    assert key.server_public_key == keys.cluster.server_public_key
    assert WorkerToken.parse(str(keys.cluster.worker_token())) == keys.cluster.worker_token()
    stored = (tmp_path / "security.sqlite3").read_bytes()
    assert key.secret not in stored and text.encode() not in stored
    assert os.stat(tmp_path / "security.sqlite3").st_mode & 0o077 == 0  # readable by its owner only
    again, created = KeyStore.init(tmp_path)  # init twice changes nothing
    assert not created and again.cluster == keys.cluster
    again.close()
    keys.close()


def test_keys_cli_prints_one_key_lists_and_revokes(tmp_path, capsys):
    state = ["--state-dir", str(tmp_path)]
    with pytest.raises(SystemExit, match="bios keys init"):
        bios_cli(["keys", "create", "dave", *state])
    assert bios_cli(["keys", "init", *state]) == 0
    capsys.readouterr()
    assert bios_cli(["keys", "create", "dave", *state]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1
    key = ApiKey.parse(printed[0])
    assert bios_cli(["keys", "worker-token", *state]) == 0
    token = WorkerToken.parse(capsys.readouterr().out.strip())
    assert token.server_public_key == key.server_public_key
    assert bios_cli(["keys", "revoke", "dave", *state]) == 0
    assert bios_cli(["keys", "list", *state]) == 0
    listing = capsys.readouterr().out
    assert "dave" in listing and key.key_id in listing and "revoked" in listing
    with pytest.raises(SystemExit, match="no active key"):
        bios_cli(["keys", "revoke", "dave", *state])
    keys = KeyStore.open(tmp_path)
    with pytest.raises(AuthenticationError, match="revoked"):
        keys.authenticate(printed[0])
    keys.close()


# ---------------------------------------------------------------------------------------------- refusals


def test_no_key_is_refused(keyed, no_env_key):
    with pytest.raises(AuthenticationError, match="requires an API key"):
        _client(keyed, None)


def test_wrong_keys_are_refused(keyed, tmp_path):
    good = ApiKey.parse(keyed.alice)
    wrong_secret = ApiKey(good.key_id, bytes(24), good.server_public_key)
    with pytest.raises(AuthenticationError, match="invalid API key"):
        _client(keyed, str(wrong_secret))
    unknown_id = ApiKey("00" * 8, good.secret, good.server_public_key)
    with pytest.raises(AuthenticationError, match="invalid API key"):
        _client(keyed, str(unknown_id))
    other, _ = KeyStore.init(tmp_path)  # a key of another cluster: its server key does not match
    with pytest.raises(AuthenticationError, match="not for the coordinator"):
        _client(keyed, str(other.create("eve")))
    other.close()
    with pytest.raises(AuthenticationError, match="malformed"):
        _client(keyed, "tml-not-a-bios-key")


def test_revoked_key_is_refused_and_its_open_session_dropped(keyed):
    frank = str(keyed.keys.create("frank"))
    client = _client(keyed, frank)
    assert client.create_rest_client().list_training_runs().result().training_runs == []
    keyed.keys.revoke("frank")
    with pytest.raises(AuthenticationError, match="revoked"):
        _client(keyed, frank)
    with pytest.raises(AuthenticationError, match="revoked"):  # what the next heartbeat hears
        client._conn.query(m.SessionHeartbeat(client.session_id))
    with pytest.raises(AuthenticationError):
        client.create_rest_client().list_training_runs().result()
    client.close()


def test_sockets_speak_curve_when_keys_exist(keyed):
    """Read the coordinator's ZMTP greeting: its security mechanism is CURVE on both ports."""
    status_client = _client(keyed, keyed.alice)
    host, port = keyed.cluster.address.removeprefix("tcp://").rsplit(":", 1)
    worker_port = status_client._conn.query(m.DiscoverWorkerEndpoint()).port
    status_client.close()
    for p in (int(port), worker_port):
        with socket.create_connection((host, p), timeout=5) as raw:
            raw.sendall(b"\xff" + bytes(8) + b"\x7f" + b"\x03")  # ZMTP signature and major version: the server
            greeting = b""  # then sends its whole greeting, mechanism included
            while len(greeting) < 64 and (chunk := raw.recv(64 - len(greeting))):
                greeting += chunk
        assert greeting[12:32].rstrip(b"\0") == b"CURVE"


# ---------------------------------------------------------------------------------------------- isolation


def test_another_key_finds_nothing_of_alices(keyed):
    alice, bob = _client(keyed, keyed.alice), _client(keyed, keyed.bob)
    tc = alice.create_lora_training_client(BASE, rank=4, seed=3)
    tc.forward_backward(BATCH).result(60)
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(60)
    state = tc.save_state("alices").result(60).path
    sampler = tc.save_weights_for_sampler("alices-sampler").result(60).path
    sampling = alice.create_sampling_client(model_path=sampler)
    rest = bob.create_rest_client()

    # reads: runs, listings, checkpoints, sampling sessions
    assert tc.model_id not in rest.list_training_run_ids().result()
    assert rest.list_training_runs().result().cursor.total_count == 0
    reads = [
        lambda: bob._conn.query(m.GetInfo(tc.model_id)),
        lambda: rest.get_training_run(tc.model_id).result(),
        lambda: rest.list_checkpoints(tc.model_id).result(),
        lambda: rest.download_checkpoint(state).result(),
        lambda: bob._conn.query(m.GetSamplingSession(sampling.sampling_session_id)),
        lambda: bob.create_sampling_client(model_path=sampler),
        lambda: bob.create_training_client_from_state(state),
    ]
    for read in reads:
        with pytest.raises(NotFoundError):
            read()

    # writes: into her run, her sampling session, her session; deleting her checkpoint; replaying her request
    loss = tc.forward(BATCH).result(60).loss
    writes = [
        m.ForwardBackward(tc.model_id, 3, BATCH, "cross_entropy"),
        m.OptimStep(tc.model_id, 3, types.AdamParams()),
        m.SaveWeights(tc.model_id, 3, "bobs", "weights"),
        m.ForwardBackward(tc.model_id, 1, BATCH, "cross_entropy"),  # already ran: its stored result must not leak
        m.Sample(sampling.sampling_session_id, 5, types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(4)),
        m.CreateModel(alice.session_id, 7, BASE, types.LoraConfig(rank=4)),
        m.CreateModel("../../outside", 0, BASE, types.LoraConfig(rank=4)),
    ]
    for op in writes:
        accepted, result = bob._conn.submit(op, f"bob-{id(op)}")
        with pytest.raises(NotFoundError):
            accepted.result(30)
        with pytest.raises(NotFoundError):
            result.result(30)
    with pytest.raises(NotFoundError):
        rest.delete_checkpoint(state).result()
    with pytest.raises(NotFoundError):
        bob._conn.query(m.CloseSession(alice.session_id))

    # bob's own work is his; alice's is untouched and still hers
    own = bob.create_lora_training_client(BASE, rank=4, seed=3)
    assert [r.training_run_id for r in rest.list_training_runs().result().training_runs] == [own.model_id]
    assert {c.bios_path for c in alice.create_rest_client().list_checkpoints(tc.model_id).result().checkpoints} == {
        state, sampler}
    run = alice.create_rest_client().get_training_run(tc.model_id).result()
    assert run.model_owner == ApiKey.parse(keyed.alice).key_id
    assert tc.forward(BATCH).result(60).loss == loss  # nothing bob sent touched her run
    alice.close()
    bob.close()


async def test_weights_a_client_sends_never_reach_a_worker(tmp_path):
    """Starting weights and sampler weights come from the caller's own checkpoints, named by the coordinator;
    tensors a client puts into CreateModel.state or Sample.adapter_state are dropped at acceptance."""
    store = Store(tmp_path)
    scheduler = Scheduler(store, Catalog(store, DirectoryCheckpointStore(tmp_path / "checkpoints")),
                          make_codec(), _no_push, lambda: None)
    store.add_session("s", "bob")
    forged = m.CheckpointState({"w": np.ones(4, np.float32)}, None, {"rank": 4, "target_modules": 7})
    create = m.CreateModel("s", 0, BASE, types.LoraConfig(rank=4), state=forged)
    await scheduler.submit(Submit(b"bob", "bob", create, [b"frame"]))
    session = scheduler.create_sampler("bob", m.CreateSamplingSession("s", 0, base_model=BASE))
    sample = m.Sample(session.sampling_session_id, 0, types.ModelInput.from_ints([1, 2]), 1,
                      types.SamplingParams(max_tokens=2), adapter_path="bios://s:train:0/sampler_weights/x",
                      adapter_state=forged)
    await scheduler.submit(Submit(b"bob", "bob", sample, [b"frame"]))
    ops = [scheduler.runs["s:train:0"].queue[0].op, scheduler.samples[0].op]  # what a cycle would send
    assert [type(op) for op in ops] == [m.CreateModel, m.Sample]
    assert ops[0].state is None and ops[1].adapter_state is None and ops[1].adapter_path is None
    store.close()


async def _no_push(peer: bytes, frames: list) -> None:
    pass


# ---------------------------------------------------------------------------------------------- binding


def test_public_bind_without_keys_refuses_to_start(tmp_path):
    with pytest.raises(InsecureListenError, match="bios keys init"):
        Coordinator(CoordinatorConfig(listen="tcp://0.0.0.0:0", state_dir=tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "bios.cli.coordinator", "--listen", "tcp://0.0.0.0:0", "--state-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2 and "refusing to listen on tcp://0.0.0.0:0 without API keys" in proc.stderr
    check_listen("tcp://0.0.0.0:7600", keys=True)  # with keys any address is fine
    for address in ("tcp://127.0.0.1:0", "tcp://localhost:7600", "tcp://[::1]:7600", "ipc:///tmp/bios.sock"):
        assert is_local_address(address)
    for address in ("tcp://0.0.0.0:7600", "tcp://*:7600", "tcp://10.1.2.3:7600", "tcp://eth0:7600", "udp://x:1"):
        assert not is_local_address(address)


async def test_the_accounts_authenticate_is_what_front_ends_call(tmp_path):
    keyless = Coordinator(CoordinatorConfig(listen="tcp://127.0.0.1:0", state_dir=tmp_path / "open"))
    assert not keyless.accounts.keys_required and keyless.accounts.authenticate(None) == LOCAL_OWNER
    _close(keyless)
    keys, _ = KeyStore.init(tmp_path / "keyed")
    key = keys.create("gateway-user")
    keyed = Coordinator(CoordinatorConfig(listen="tcp://0.0.0.0:0", state_dir=tmp_path / "keyed"))
    assert keyed.accounts.keys_required
    assert keyed.accounts.authenticate("tml-" + str(key)) == key.key_id
    with pytest.raises(AuthenticationError):
        keyed.accounts.authenticate(None)
    token = keys.cluster.worker_token()
    register = m.RegisterWorker("w", "h", 1, "cpu", 1, token=None)
    forged = m.RegisterWorker("w", "h", 1, "cpu", 1, token=str(WorkerToken(bytes(32), token.server_public_key)))
    for message in (register, forged):
        with pytest.raises(AuthenticationError, match="worker token"):
            keyed.workers.dispatch(b"w", Envelope(1, message), [])
    accepted = keyed.workers.dispatch(b"w", Envelope(1, m.RegisterWorker("w", "h", 1, "cpu", 1, token=str(token))), [])
    assert isinstance(accepted.result(), m.WorkerAccepted)
    _close(keyed)
    keys.close()


def _close(coordinator: Coordinator) -> None:
    coordinator.close_sockets()
    coordinator.store.close()
    if coordinator.keys is not None:
        coordinator.keys.close()
    coordinator.ctx.term()


# ---------------------------------------------------------------------------------------------- workers


async def test_worker_without_the_token_is_rejected(keyed):
    """No token: the coordinator's sockets do not even finish a handshake with it. A forged token (the right
    server key, a wrong secret): the ZAP handler refuses the CurveZMQ key it derives. (`bios-worker` exits with
    code 2 on either.)"""
    forged = str(WorkerToken(bytes(32), keyed.keys.cluster.server_public_key))
    for token, refusal in ((None, "requires a worker token"), (forged, "refused this worker's token")):
        daemon = WorkerDaemon(WorkerConfig(keyed.cluster.address, torch.device("cpu"), token=token,
                                           discover_timeout_s=20))
        with pytest.raises(AuthenticationError, match=refusal):
            await daemon.run()
        if daemon.remote is not None:
            await daemon.trainer.stop()
            await daemon.remote.close()
        daemon.ctx.destroy(linger=0)
    client = _client(keyed, keyed.alice)
    assert [w.state for w in client.cluster_status().workers] == ["active"]  # only the legitimate worker
    assert client.ping() > 0
    client.close()
