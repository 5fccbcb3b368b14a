"""docs/run-a-cluster.md, "Try it on one machine", run as written: keys, `bios up --detach` with the gateway,
metrics and checkpoints, the native and the Tinker SDK training, `bios status`, `bios logs`, `bios down`; free
ports in place of the guide's, and no process left at the end."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from bios.cli.up_record import read_record

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "run-a-cluster.md"
SECTION = "## Try it on one machine"


def guide_blocks() -> list[tuple[str, str]]:
    """(language, code) of each fenced block of the tested section, in order."""
    text = GUIDE.read_text()
    section = text[text.index(SECTION):]
    section = section[:section.index("\n## ", len(SECTION))]
    return re.findall(r"```(bash|python)\n(.*?)```", section, flags=re.S)


def free_ports(n: int) -> list[int]:
    """n free ports, each with its successor free too (the coordinator's worker port is the client port + 1)."""
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        if port not in ports and port + 1 not in ports:
            ports.append(port)
    return ports


def run_bash(code: str, cwd: Path, env: dict[str, str]) -> tuple[str, dict[str, str]]:
    """Run a block as one script (so `export` carries to the next block); returns its output and environment."""
    env_file = cwd / ".env-after"
    script = f"set -euo pipefail\n{code}\nenv -0 > {env_file}\n"
    done = subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{code}\n---\n{done.stdout}\n{done.stderr}"
    pairs = [item.split("=", 1) for item in env_file.read_text().split("\0") if "=" in item]
    return done.stdout + done.stderr, dict(pairs)


def losses(output: str, label: str) -> list[float]:
    return [float(x) for x in re.findall(rf"{label} step \d+: loss ([0-9.]+)", output)]


@pytest.mark.e2e
def test_the_guide_runs_on_one_machine(tmp_path):
    blocks = guide_blocks()
    assert [lang for lang, _ in blocks] == ["bash", "python", "python", "bash"]
    client, http, metrics = free_ports(3)
    ports = {"7600": str(client), "8000": str(http), "9600": str(metrics)}
    env = {k: v for k, v in os.environ.items() if k not in ("BIOS_ADDRESS", "BIOS_API_KEY", "BIOS_STATE_DIR")}
    env.update(OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    outputs: list[str] = []
    cluster: list[psutil.Process] = []
    try:
        for lang, code in blocks:
            code = re.sub(r"\b(7600|8000|9600)\b", lambda m: ports[m.group(1)], code)
            if lang == "python":
                done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                                      text=True, timeout=300)
                assert done.returncode == 0, done.stderr[-3000:]
                outputs.append(done.stdout)
                continue
            if "bios down" in code:  # everything `bios up` started, to check that `bios down` ends it all
                record = read_record(tmp_path / "bios-state")
                assert record is not None
                up = psutil.Process(record.pid)
                cluster = [up, *up.children(recursive=True)]
                assert len(cluster) == 4  # bios up, the coordinator, two workers
                outputs.append(follow_a_log(tmp_path, env))
            out, env = run_bash(code, tmp_path, env)
            outputs.append(out)
    finally:
        record = read_record(tmp_path / "bios-state")
        if record is not None:  # a failed step: stop the cluster anyway
            os.kill(record.pid, signal.SIGTERM)
            psutil.Process(record.pid).wait(90)
    banner, native, tinker_out, final = outputs[0], outputs[1], outputs[2], outputs[-1]
    assert f"tcp://127.0.0.1:{client}" in banner and f"http://127.0.0.1:{http}" in banner
    assert "required: bios keys create" in banner and "bios-state/coordinator.log" in banner
    for output, label in ((native, "native"), (tinker_out, "tinker")):
        trained = losses(output, label)
        assert len(trained) == 4 and trained[-1] < trained[0], output
    assert "saved bios://" in native
    assert "active" in final and "cycle_s=0" in final
    assert re.search(r'bios_cycles_total\{outcome="committed"\} [1-9]', final), final
    assert " worker INFO " in final and " coordinator INFO " in final  # bios logs of both kinds
    assert "stopped the cluster" in final
    assert outputs[3].strip(), "bios logs -f printed nothing"
    time.sleep(0.5)
    assert not [p.pid for p in cluster if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert read_record(tmp_path / "bios-state") is None


def follow_a_log(cwd: Path, env: dict[str, str]) -> str:
    """`bios logs worker 0 -f` prints the log and keeps running until interrupted."""
    follow = subprocess.Popen([sys.executable, "-m", "bios.cli", "logs", "worker", "0", "-f"], cwd=cwd, env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert follow.stdout is not None
        first = follow.stdout.readline()
        assert follow.poll() is None, "bios logs -f stopped by itself"
    finally:
        follow.send_signal(signal.SIGINT)
        follow.wait(10)
    assert follow.returncode == 0
    return first
