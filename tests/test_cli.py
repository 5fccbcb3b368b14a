"""The `bios` command against a running cluster: status, runs, checkpoints, export."""

from __future__ import annotations

import subprocess
import sys

from conftest import BASE, text_datum


def bios_cli(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "bios.cli", *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_status_runs_checkpoints_and_export(cluster, service, tmp_path):
    tc = service.create_lora_training_client(BASE, rank=8, seed=71)
    tc.forward_backward([text_datum("command line")]).result(60)
    tc.optim_step().result(60)
    path = tc.save_weights_for_sampler("cli").result(60).path

    status = bios_cli("status", "--address", cluster.address)
    assert "active" in status and "cycles:" in status
    assert f"state dir {cluster.state_dir}" in status and "GiB free of" in status
    assert tc.model_id in bios_cli("runs", "list", "--address", cluster.address)
    listing = bios_cli("checkpoints", "list", tc.model_id, "--address", cluster.address)
    assert path in listing and "sampler" in listing
    exported = bios_cli("checkpoint", "export", path, str(tmp_path / "peft"), "--address", cluster.address)
    assert "PEFT adapter" in exported
    assert (tmp_path / "peft" / "adapter_config.json").exists()
