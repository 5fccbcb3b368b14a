"""A full state directory is an error, not an outage (issue 14, item 7).

The coordinator's state dir is a small tmpfs filled by saves: the save that does not fit fails at once naming the
full directory, nothing partial is left, deleting checkpoints frees space and saves work again, SQLite stays
intact, and training goes on throughout; when the request log itself cannot be written, each request fails with
the same error and training resumes once space is freed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import BASE, text_datum

import bios
from bios import types
from bios.checkpoint_path import CheckpointPath
from bios.coordinator.checkpoints import DirectoryCheckpointStore
from bios.coordinator.disk import RESERVE_NAME, GiB, MiB, StateDisk, Usage, is_disk_full
from bios.coordinator.store import Store
from bios.exceptions import RequestFailedError
from bios.messages import CheckpointState

BATCH = [text_datum("A full disk is an error, not an outage."), text_datum("Free space and go on.")]
PARAMS = types.AdamParams(learning_rate=1e-3)
MAX_SAVES = 200  # far more than fit in the 40 MiB state dir


@contextlib.contextmanager
def tmpfs(path: Path, mib: int) -> Iterator[Path]:
    """A `mib` MiB tmpfs mounted at `path` for the duration (needs root or CAP_SYS_ADMIN)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.fail(f"this test mounts a {mib} MiB tmpfs as a small state dir and needs root (or CAP_SYS_ADMIN) "
                    f"for it: `mount -t tmpfs` said {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True)


def fill(path: Path) -> Path:
    """Write a ballast file in `path` until the filesystem has no byte left."""
    ballast = path / f"ballast-{len(list(path.glob('ballast-*')))}"
    with open(ballast, "wb", buffering=0) as f:
        for chunk in (MiB, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * chunk)
    return ballast


def assert_full_disk_error(exc: BaseException, state_dir: Path) -> None:
    message = str(exc)
    assert isinstance(exc, RequestFailedError), repr(exc)
    assert f"state directory {state_dir} is full" in message, message
    assert "free of" in message and "RestClient.delete_checkpoint" in message, message


def step(tc) -> None:
    tc.forward_backward(BATCH).result(60)
    tc.optim_step(PARAMS).result(60)


def leftovers(checkpoints: Path) -> list[Path]:
    """Temp directories or files of saves that did not finish."""
    return [p for p in checkpoints.rglob("*") if p.name.startswith(".") or p.name.endswith(".tmp")]


def integrity(state_dir: Path) -> str:
    db = sqlite3.connect(state_dir / "coordinator.sqlite3")
    try:
        return db.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        db.close()


def test_state_dir_filled_by_saves(tmp_path):
    with tmpfs(tmp_path / "state", 40) as state_dir:
        checkpoints = state_dir / "checkpoints"
        with bios.LocalCluster(state_dir=state_dir, cycle_s=0, worker_threads=1, log_level="WARNING") as cluster:
            service = bios.ServiceClient(address=cluster.address)
            try:
                tc = service.create_lora_training_client(BASE, rank=32, seed=14)
                rest = service.create_rest_client()
                step(tc)

                # Saves until one does not fit; training goes on between them.
                saved: list[str] = []
                refused: BaseException | None = None
                while refused is None and len(saved) < MAX_SAVES:
                    try:
                        saved.append(tc.save_state(f"fill-{len(saved):03d}").result(60).path)
                    except RequestFailedError as exc:
                        refused = exc
                    step(tc)
                assert refused is not None, f"{len(saved)} saves all fit in a 40 MiB state dir"
                assert_full_disk_error(refused, state_dir)
                assert f"fill-{len(saved):03d}" in str(refused)
                print(f"{len(saved)} saves fit; then: {refused}")
                run_dir = checkpoints / tc.model_id / "weights"
                assert sorted(p.name for p in run_dir.iterdir()) == [f"fill-{i:03d}" for i in range(len(saved))]
                assert leftovers(checkpoints) == []
                with pytest.raises(RequestFailedError) as again:  # still full: the same error, at once
                    tc.save_state("one-more").result(60)
                assert_full_disk_error(again.value, state_dir)
                listed = rest.list_checkpoints(tc.model_id).result().checkpoints
                assert sorted(c.bios_path for c in listed) == sorted(saved)

                # Deleting checkpoints frees space, and saves work again.
                free_before = os.statvfs(state_dir).f_bavail
                for path in saved[:3]:
                    rest.delete_checkpoint(path).result()
                assert os.statvfs(state_dir).f_bavail > free_before
                assert not (run_dir / "fill-000").exists()
                after = tc.save_state("after-delete").result(60).path
                step(tc)

                # The request log itself cannot be written: each request fails at once with the same error.
                ballast = fill(state_dir)
                failed: BaseException | None = None
                for steps in range(MAX_SAVES):
                    try:
                        step(tc)
                    except RequestFailedError as exc:
                        failed = exc
                        break
                    fill(state_dir)  # whatever the coordinator released (its reserve) is taken again
                assert failed is not None, "the request log was still written on a full disk"
                print(f"the request log filled after {steps} more steps: {failed}")
                assert_full_disk_error(failed, state_dir)
                with pytest.raises(RequestFailedError) as refused_fb:
                    tc.forward_backward(BATCH).result(60)
                assert_full_disk_error(refused_fb.value, state_dir)
                with pytest.raises(RequestFailedError) as refused_save:
                    tc.save_state("on-a-full-disk").result(60)
                assert_full_disk_error(refused_save.value, state_dir)
                assert leftovers(checkpoints) == []

                # Space comes back: deletes work, training and saves resume on the same run.
                for extra in state_dir.glob("ballast-*"):
                    extra.unlink()
                assert not ballast.exists()
                rest.delete_checkpoint(saved[3]).result()
                step(tc)
                loss = tc.forward_backward(BATCH).result(60).loss
                assert np.isfinite(loss)
                tc.optim_step(PARAMS).result(60)
                final = tc.save_state("resumed").result(60).path
                listed = {c.bios_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
                assert {after, final} <= listed and saved[3] not in listed
                assert (state_dir / RESERVE_NAME).exists()  # set aside again
            finally:
                service.close()
        assert integrity(state_dir) == "ok"
        assert leftovers(checkpoints) == []


def test_a_put_that_does_not_fit_leaves_nothing(tmp_path):
    with tmpfs(tmp_path / "small", 1) as root:
        files = DirectoryCheckpointStore(root / "checkpoints")
        state = CheckpointState(adapter={"w": np.ones(512 * 1024, np.float32)}, optimizer=None, metadata={})
        with pytest.raises(Exception) as raised:  # safetensors raises its own error, not OSError
            files.put(CheckpointPath("run", "weights", "big"), state)
        assert is_disk_full(raised.value)
        assert list((root / "checkpoints").rglob("*")) == []


def test_request_log_on_a_full_disk(tmp_path):
    """The store gives up its reserve first, then fails with the full-disk error; heartbeats never fail."""
    with tmpfs(tmp_path / "small", 4) as state_dir:
        store = Store(state_dir)
        try:
            assert (state_dir / RESERVE_NAME).exists()
            store.add_session("s", "owner")
            ballast = fill(state_dir)
            with pytest.raises(RequestFailedError) as raised:
                for i in range(1000):
                    store.add_request(f"r{i}", "run", i, "ForwardBackward", [b"x" * 65536])
            assert_full_disk_error(raised.value, state_dir)
            assert not (state_dir / RESERVE_NAME).exists()  # released before failing
            assert store.touch_session("s")
            assert store.get_request(f"r{i}") is None  # the refused request left no row
            ballast.unlink()
            store.add_request("after", "run", 1000, "ForwardBackward", [b"x"])
            assert store.disk.hold() and (state_dir / RESERVE_NAME).exists()
        finally:
            store.close()
        assert integrity(state_dir) == "ok"


def test_status_warns_well_before_the_disk_is_full(tmp_path):
    assert not Usage(free_bytes=50 * GiB, total_bytes=100 * GiB).low
    assert Usage(free_bytes=4 * GiB, total_bytes=100 * GiB).low  # under 5%
    assert Usage(free_bytes=900 * MiB, total_bytes=10 * GiB).low  # under 1 GiB
    with tmpfs(tmp_path / "small", 8) as state_dir:
        space = StateDisk(state_dir).space()
        assert space.path == str(state_dir) and 0 < space.free_bytes < space.total_bytes
        assert "running out of space" in space.warning and "RestClient.delete_checkpoint" in space.warning


def test_disk_full_errors_are_recognised():
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(sqlite3.OperationalError("database or disk is full"))
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as cause:
            raise RuntimeError("wrapped") from cause
    except RuntimeError as wrapped:
        assert is_disk_full(wrapped)
