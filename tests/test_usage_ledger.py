"""The accounting under the Tinker account routes, on a bare coordinator store (no cluster): token usage, storage
GB-hours from checkpoint lifetimes, the audit log's triggers and filters, checkpoint labels and signed links."""

from __future__ import annotations

import time

import pytest

from bios import messages as m
from bios import types as t
from bios.coordinator.audit import AuditLog
from bios.coordinator.labels import Labels
from bios.coordinator.store import Store, StoredCheckpoint
from bios.coordinator.usage import Usage
from bios.exceptions import AuthenticationError, BadRequestError
from bios.gateway.signed_urls import SignedUrls
from bios.security.keys import KeyInfo

RUN = "sess1:train:0"
PATH = f"bios://{RUN}/weights/step1"
HOUR = 3600.0


@pytest.fixture
def store(tmp_path):
    store = Store(tmp_path)
    Labels(store)
    AuditLog(store.db)
    store.add_session("sess1", "alice")
    store.add_run(RUN, "sess1", "alice", "bios/tiny-llama", {"rank": 4})
    yield store
    store.close()


def _checkpoint(store: Store, created: float, size: int, path: str = PATH) -> None:
    store.add_checkpoint(StoredCheckpoint(path, RUN, "weights", path.rsplit("/", 1)[1], "alice", created, size, 1,
                                          False))


def test_tokens_are_counted_per_key_when_requests_finish(store):
    usage = Usage(store)
    data = [t.Datum(model_input=t.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={}),
            t.Datum(model_input=t.ModelInput.from_ints([4, 5]), loss_fn_inputs={})]
    usage.record(m.ForwardBackward(RUN, 1, data, "cross_entropy"), t.ForwardBackwardOutput("x", [], {}))
    usage.record(m.ForwardBackward("nobody:train:0", 1, data, "cross_entropy"), t.ForwardBackwardOutput("x", [], {}))
    now = time.time()
    buckets = usage.buckets("alice", now - HOUR, now + HOUR)
    assert [(b.kind, b.quantity, b.session_id) for b in buckets] == [("training", 5.0, "sess1")]
    assert usage.buckets("bob", now - HOUR, now + HOUR) == []


def test_storage_is_size_times_lifetime_split_by_hour(store):
    usage = Usage(store)
    hour = (time.time() // HOUR - 3) * HOUR
    _checkpoint(store, hour + 0.5 * HOUR, 2_000_000_000)  # 2 GB saved half-way into the first hour
    _checkpoint(store, hour + 1.5 * HOUR, 1_000_000_000)  # replaced by 1 GB one hour later (an overwrite)
    buckets = usage.buckets(None, hour, hour + 2 * HOUR)
    storage = {b.bucket_start: b.quantity for b in buckets if b.kind == "storage"}
    assert storage[hour] == pytest.approx(2 * 0.5)  # 2 GB for half an hour
    assert storage[hour + HOUR] == pytest.approx(2 * 0.5 + 1 * 0.5)
    assert sum(b.quantity for b in buckets if b.kind == "checkpoint") == 2
    store.delete_checkpoint(PATH)
    assert usage.stored_now("alice") == []
    later = usage.buckets("alice", hour + 2 * HOUR, time.time() + HOUR)
    gb_hours = sum(b.quantity for b in later if b.kind == "storage")
    assert gb_hours == pytest.approx((time.time() - (hour + 2 * HOUR)) / HOUR, rel=1e-3)  # stopped at deletion


def test_audit_log_records_runs_and_deletions_and_filters_by_kind(store):
    audit = AuditLog(store.db)
    _checkpoint(store, time.time(), 10)
    store.delete_checkpoint(PATH)
    audit.record("alice", "checkpoint_published", path=PATH)
    keys = [KeyInfo("alice", "alice", time.time(), None), KeyInfo("bob", "bob", time.time(), time.time())]
    now = time.time()
    events = [e.event for e in audit.entries("alice", now - HOUR, now + HOUR, keys=keys)]
    assert sorted(events) == ["api_key_created", "checkpoint_deleted", "checkpoint_published",
                              "training_run_created"]
    assert {e.event for e in audit.entries(None, now - HOUR, now + HOUR, keys=keys)} >= {"api_key_revoked"}
    assert [e.event for e in audit.entries("alice", now - HOUR, now + HOUR, "checkpoints")] == [
        "checkpoint_deleted", "checkpoint_published"]
    with pytest.raises(BadRequestError, match="event_type"):
        audit.entries("alice", now - HOUR, now + HOUR, "everything")


def test_labels_expire_checkpoints_and_number_sampling_clients_durably(store, tmp_path):
    labels = Labels(store)
    _checkpoint(store, time.time(), 10)
    expires = labels.set_ttl(PATH, 3600)
    assert labels.expired() == [] and labels.expired(expires + 1) == [(PATH, "alice")]
    labels.publish(PATH, True)
    assert labels.checkpoint(PATH).public
    store.delete_checkpoint(PATH)
    assert labels.checkpoint(PATH).public is False and labels.expired(expires + 1) == []
    assert [labels.join_sampling_session("s:sample:0") for _ in range(2)] == [1, 2]
    assert Labels(store).join_sampling_session("s:sample:0") == 3


def test_signed_links_open_one_path_until_they_expire():
    urls = SignedUrls(b"k" * 32)
    url, _ = urls.sign("http://h", "checkpoints/r/weights/a/adapter.safetensors")
    expires, sig = url.split("expires=")[1].split("&sig=")
    urls.check("checkpoints/r/weights/a/adapter.safetensors", expires, sig)
    with pytest.raises(AuthenticationError, match="not valid"):
        urls.check("checkpoints/r/weights/a/optimizer.safetensors", expires, sig)
    stale, _ = urls.sign("http://h", "x", lifetime_s=-10)
    expires, sig = stale.split("expires=")[1].split("&sig=")
    with pytest.raises(AuthenticationError, match="expired"):
        urls.check("x", expires, sig)
