"""Tinker options the official SDK sends that Bios must keep, not drop (issue 40), driven through tinker 0.38 against
one keyed Bios cluster:

- `user_metadata` on `create_lora_training_client`, `create_training_client_from_state`, `save_state` and
  `save_weights_for_sampler`: returned by `get_training_run`, `list_training_runs` and `list_checkpoints`, also
  after the coordinator restarts; the native SDK takes and returns the same;
- `list_training_runs(project_id=...)`: only the runs of that project's sessions; none for an unknown project;
- `get_weights_info_by_tinker_path`: the run's real `train_mlp` / `train_attn` / `train_unembed`;
- `get_tokenizer()` of a built-in model, with the Hugging Face hub unreachable (`HF_HUB_OFFLINE`).
"""

from __future__ import annotations

import sqlite3

import huggingface_hub.constants
import pytest
import tinker
from tinker import types as tt

import bios
from bios.coordinator.store import Store
from bios.exceptions import BadRequestError
from bios.security.keys import KeyStore

BASE = "bios/tiny-llama"

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


class Keyed:
    def __init__(self, cluster: bios.LocalCluster, alice: str, bob: str) -> None:
        self.cluster, self.url, self.address = cluster, cluster.http_url, cluster.address
        self.alice, self.bob = alice, bob


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    state_dir = tmp_path_factory.mktemp("options")
    keys, _ = KeyStore.init(state_dir)
    alice, bob = f"tml-{keys.create('alice')}", f"tml-{keys.create('bob')}"
    keys.close()
    with bios.LocalCluster(state_dir=state_dir, http="127.0.0.1:0", worker_threads=1,
                           env={"BIOS_GATEWAY_POLL_S": "2"}) as cluster:
        yield Keyed(cluster, alice, bob)


def _checkpoints(rest: tinker.RestClient, run_id: str) -> dict[str, tt.Checkpoint]:
    return {c.tinker_path: c for c in rest.list_checkpoints(run_id).result().checkpoints}


def test_user_metadata_is_kept_on_runs_and_checkpoints_across_a_restart(keyed):
    svc = tinker.ServiceClient(base_url=keyed.url, api_key=keyed.alice)
    tc = svc.create_lora_training_client(base_model=BASE, rank=4, seed=1,
                                         user_metadata={"experiment": "e1", "owner": "ml"}).result()
    plain = svc.create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
    state = tc.save_state("meta-state", user_metadata={"kind": "state"}).result(60).path
    sampler = tc.save_weights_for_sampler("meta-sampler", user_metadata={"kind": "sampler"}).result(60).path
    bare = tc.save_state("meta-bare").result(60).path
    resumed = svc.create_training_client_from_state(state, user_metadata={"from": "state"}).result()

    def check(rest: tinker.RestClient) -> None:
        run = rest.get_training_run(tc.model_id).result()
        assert run.user_metadata == {"experiment": "e1", "owner": "ml"}
        assert run.last_checkpoint.tinker_path == bare and run.last_checkpoint.user_metadata is None
        assert run.last_sampler_checkpoint.user_metadata == {"kind": "sampler"}
        assert rest.get_training_run(plain.model_id).result().user_metadata is None
        assert rest.get_training_run(resumed.model_id).result().user_metadata == {"from": "state"}
        listed = {r.training_run_id: r for r in rest.list_training_runs(limit=100).result().training_runs}
        assert listed[tc.model_id].user_metadata == {"experiment": "e1", "owner": "ml"}
        checkpoints = _checkpoints(rest, tc.model_id)
        assert checkpoints[state].user_metadata == {"kind": "state"}
        assert checkpoints[sampler].user_metadata == {"kind": "sampler"}
        assert checkpoints[bare].user_metadata is None
        mine = {c.tinker_path: c for c in rest.list_user_checkpoints(limit=1000).result().checkpoints}
        assert mine[state].user_metadata == {"kind": "state"}

    check(svc.create_rest_client())
    keyed.cluster.restart_coordinator()
    check(tinker.RestClient(base_url=keyed.url, api_key=keyed.alice))
    # and the run still trains and saves after the restart, its metadata unchanged
    tc.forward_backward([_datum("after the restart")], "cross_entropy").result(60)
    later = tc.save_state("meta-later", user_metadata={"after": "restart"}).result(60).path
    rest = tinker.RestClient(base_url=keyed.url, api_key=keyed.alice)
    assert _checkpoints(rest, tc.model_id)[later].user_metadata == {"after": "restart"}
    assert rest.get_training_run(tc.model_id).result().user_metadata == {"experiment": "e1", "owner": "ml"}
    # a copy keeps its source's metadata
    copy = rest.copy_weights(state, "opt-copies").result()
    copy_run = copy.removeprefix("tinker://").split("/")[0]
    assert _checkpoints(rest, copy_run)[copy].user_metadata == {"kind": "state"}


def test_user_metadata_must_be_strings(keyed):
    svc = tinker.ServiceClient(base_url=keyed.url, api_key=keyed.alice)
    tc = svc.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    too_many = {f"k{i}": "v" for i in range(65)}
    with pytest.raises(tinker.BadRequestError, match="user_metadata"):
        tc.save_state("too-much", user_metadata=too_many).result(60)
    assert tc.save_state("fine", user_metadata={"k": "v"}).result(60).path.endswith("/weights/fine")


def test_the_native_sdk_keeps_user_metadata(keyed):
    with bios.ServiceClient(address=keyed.address, api_key=keyed.alice) as svc:
        tc = svc.create_lora_training_client(BASE, rank=4, seed=4, user_metadata={"sdk": "native"})
        path = tc.save_state("native-state", user_metadata={"step": "0"}).result(60).path
        sampler = tc.save_weights_for_sampler("native-sampler", user_metadata={"for": "eval"}).result(60).path
        rest = svc.create_rest_client()
        run = rest.get_training_run(tc.model_id).result()
        assert run.user_metadata == {"sdk": "native"}
        assert run.last_checkpoint.user_metadata == {"step": "0"}
        listed = {c.bios_path: c.user_metadata for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
        assert listed == {path: {"step": "0"}, sampler: {"for": "eval"}}
        resumed = svc.create_training_client_from_state(path, user_metadata={"from": "native-state"})
        assert rest.get_training_run(resumed.model_id).result().user_metadata == {"from": "native-state"}
        # a native session has no project label: its runs are in `default`
        in_default = rest.list_training_runs(100, project_id="default").result().training_runs
        assert {tc.model_id, resumed.model_id} <= {r.training_run_id for r in in_default}
        assert rest.list_training_runs(100, project_id="no-such-project").result().training_runs == []
        with pytest.raises(BadRequestError, match="user_metadata"):
            svc.create_lora_training_client(BASE, rank=4, user_metadata={"n": 1})  # type: ignore[dict-item]
        with pytest.raises(BadRequestError, match="user_metadata"):
            tc.save_state("bad", user_metadata={"n": ["x"]})  # type: ignore[dict-item]


def test_list_training_runs_filters_by_project(keyed):
    def runs_in(project: str | None, rest: tinker.RestClient) -> list[str]:
        page = rest.list_training_runs(limit=1000, project_id=project).result()
        assert page.cursor.total_count == len(page.training_runs)
        return [r.training_run_id for r in page.training_runs]

    in_a = tinker.ServiceClient(base_url=keyed.url, api_key=keyed.alice, project_id="opt-proj-a")
    in_b = tinker.ServiceClient(base_url=keyed.url, api_key=keyed.alice, project_id="opt-proj-b")
    nowhere = tinker.ServiceClient(base_url=keyed.url, api_key=keyed.alice)
    a1 = in_a.create_lora_training_client(base_model=BASE, rank=4, seed=5).result().model_id
    a2 = in_a.create_lora_training_client(base_model=BASE, rank=4, seed=6).result().model_id
    b1 = in_b.create_lora_training_client(base_model=BASE, rank=4, seed=7).result().model_id
    d1 = nowhere.create_lora_training_client(base_model=BASE, rank=4, seed=8).result().model_id
    rest = tinker.RestClient(base_url=keyed.url, api_key=keyed.alice)

    assert runs_in("opt-proj-a", rest) == [a1, a2]
    assert runs_in("opt-proj-b", rest) == [b1]
    assert runs_in("no-such-project", rest) == []
    default = runs_in("default", rest)
    assert d1 in default and not {a1, a2, b1} & set(default)
    assert {a1, a2, b1, d1} <= set(runs_in(None, rest))
    page = rest.list_training_runs(limit=1, offset=1, project_id="opt-proj-a").result()
    assert [r.training_run_id for r in page.training_runs] == [a2] and page.cursor.total_count == 2
    # another key's project of the same name is not this key's
    bob = tinker.RestClient(base_url=keyed.url, api_key=keyed.bob)
    assert runs_in("opt-proj-a", bob) == []
    # moving a session moves its runs
    rest.assign_session_project(in_b.holder.get_session_id(), "opt-proj-a").result()
    assert runs_in("opt-proj-a", rest) == [a1, a2, b1] and runs_in("opt-proj-b", rest) == []


def test_weights_info_reports_what_the_run_trains(keyed):
    svc = tinker.ServiceClient(base_url=keyed.url, api_key=keyed.alice)
    rest = svc.create_rest_client()
    cases = [{"train_mlp": False, "train_attn": True, "train_unembed": False},
             {"train_mlp": True, "train_attn": False, "train_unembed": True},
             {"train_mlp": True, "train_attn": True, "train_unembed": True}]
    for i, flags in enumerate(cases):
        tc = svc.create_lora_training_client(base_model=BASE, rank=4, seed=10 + i, **flags).result()
        path = tc.save_state(f"flags-{i}").result(60).path
        info = rest.get_weights_info_by_tinker_path(path).result()
        assert (info.train_mlp, info.train_attn, info.train_unembed) == (
            flags["train_mlp"], flags["train_attn"], flags["train_unembed"]), flags
        assert info.lora_rank == 4 and info.base_model == BASE and info.is_lora
        sampler = tc.save_weights_for_sampler(f"flags-sampler-{i}").result(60).path
        assert rest.get_weights_info_by_tinker_path(sampler).result().train_mlp == flags["train_mlp"]
        if i == 0:  # a run resumed from a checkpoint trains what the checkpoint's run trained
            resumed = svc.create_training_client_from_state(path).result()
            again = resumed.save_state("flags-resumed").result(60).path
            info = rest.get_weights_info_by_tinker_path(again).result()
            assert (info.train_mlp, info.train_attn, info.train_unembed) == (False, True, False)


def test_get_tokenizer_of_a_built_in_model_works_offline(keyed, monkeypatch):
    svc = tinker.ServiceClient(base_url=keyed.url, api_key=keyed.alice)
    tc = svc.create_lora_training_client(base_model=BASE, rank=4, seed=20).result()
    sampler = tc.save_weights_for_sampler("tokenizer-sampler").result(60).path
    sc = svc.create_sampling_client(model_path=sampler).result()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # already imported: set it there too
    text = "Bios, offline."
    for tokenizer in (tc.get_tokenizer(), sc.get_tokenizer()):
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
        assert tokenizer.encode(text, add_special_tokens=False) == list(text.encode())  # the byte tokenizer
    assert tc.get_info().model_data.model_name == BASE  # the name stays the name; only the tokenizer id is a path


def test_a_state_dir_from_before_user_metadata_is_migrated(tmp_path):
    """A coordinator opening a state directory whose tables lack the user_metadata columns adds them; its old rows
    read back with no metadata, and new ones keep theirs."""
    db = sqlite3.connect(tmp_path / "coordinator.sqlite3")
    db.executescript("""
        CREATE TABLE runs (model_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, owner TEXT NOT NULL,
            base_model TEXT NOT NULL, lora_config TEXT NOT NULL, created REAL NOT NULL,
            last_request_time REAL NOT NULL, status TEXT NOT NULL, info TEXT);
        CREATE TABLE checkpoints (path TEXT PRIMARY KEY, run_id TEXT NOT NULL, kind TEXT NOT NULL, name TEXT NOT NULL,
            owner TEXT NOT NULL, created REAL NOT NULL, size_bytes INTEGER NOT NULL, step INTEGER NOT NULL,
            automatic INTEGER NOT NULL DEFAULT 0);
        INSERT INTO runs VALUES ('s:train:0', 's', 'alice', 'bios/tiny-llama', '{"rank": 4}', 1.0, 1.0, 'ready', NULL);
        INSERT INTO checkpoints VALUES ('bios://s:train:0/weights/a', 's:train:0', 'weights', 'a', 'alice', 1.0, 10,
            1, 0);
    """)
    db.close()
    store = Store(tmp_path)
    try:
        old = store.get_run("s:train:0")
        assert old is not None and old.user_metadata is None and old.lora_config == {"rank": 4}
        assert [c.user_metadata for c in store.list_checkpoints("s:train:0")] == [None]
        store.add_run("s:train:1", "s", "alice", "bios/tiny-llama", {"rank": 4}, {"k": "v"})
        assert store.get_run("s:train:1").user_metadata == {"k": "v"}
        assert [r.model_id for r in store.list_runs("alice")] == ["s:train:0", "s:train:1"]
    finally:
        store.close()
    Store(tmp_path).close()  # opening it again finds the columns there


def _datum(text: str) -> tt.Datum:
    tokens = list(text.encode())
    return tt.Datum(model_input=tt.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
