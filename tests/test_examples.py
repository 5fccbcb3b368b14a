"""The examples run as written (a few steps each, pointed at the session's cluster by BIOS_ADDRESS, as a script
run against a cluster is; tests/test_processes.py starts the embedded cluster of `ServiceClient()`) and do what
they claim: the training examples' losses are finite and fall at every step, parallel_eval's adapter learns its
answer, and rl.py reports well-formed rewards."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))
STEPS = 3  # two optimizer updates between the first and the last reported loss

# The per-step line each training example prints: the step and the loss it reports (summed or per token).
LOSS_LINES = {
    "async_pipeline.py": r"step +(\d+) +loss +(\S+) +lr 0\.001$",
    "grad_accumulation.py": r"step +(\d+) +summed loss +(\S+) +grad_norm +\S+$",
    "sft.py": r"step +(\d+) +loss per reply token +(\S+)$",
    "sync_loop.py": r"step +(\d+) +loss/token +(\S+) +grad_norm +\S+ .* lr 0\.001$",
}
OTHERS = {"parallel_eval.py", "rl.py"}


def _run(cluster, path: Path, *args: str) -> str:
    env = {**os.environ, "BIOS_ADDRESS": cluster.address}
    done = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _matches(pattern: str, stdout: str) -> list[re.Match[str]]:
    return [m for m in (re.fullmatch(pattern, line.strip()) for line in stdout.splitlines()) if m]


def test_every_example_is_checked():
    assert {p.name for p in EXAMPLES} == set(LOSS_LINES) | OTHERS


@pytest.mark.e2e
@pytest.mark.parametrize("name", sorted(LOSS_LINES))
def test_training_example_losses_are_finite_and_fall_every_step(cluster, name):
    stdout = _run(cluster, Path(__file__).parent.parent / "examples" / name, str(STEPS))
    lines = _matches(LOSS_LINES[name], stdout)
    assert [int(m.group(1)) for m in lines] == list(range(STEPS)), stdout
    losses = [float(m.group(2)) for m in lines]
    assert all(math.isfinite(loss) and loss > 0 for loss in losses), losses
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses
    if name == "sft.py":
        assert re.search(r"^Q: .+\nA: ", stdout, re.MULTILINE), stdout  # it samples from the trained adapter


@pytest.mark.e2e
def test_parallel_eval_learns_its_answer(cluster):
    """One round: greedy answers of the untrained adapter, then after four steps (0% -> 100% when written)."""
    stdout = _run(cluster, Path(__file__).parent.parent / "examples" / "parallel_eval.py", "1")
    lines = _matches(r"step +(\d+) +32 prompts in \S+s +exact answers (\d+)%", stdout)
    assert [int(m.group(1)) for m in lines] == [0, 4], stdout
    before, after = (int(m.group(2)) for m in lines)
    assert before <= 10 and after >= 90, stdout


@pytest.mark.e2e
def test_rl_example_reports_well_formed_rewards(cluster):
    """Two steps cannot show the reward climbing (the example samples unseeded): every step reports a mean
    reward and a best one that are shares of lowercase letters, the best at least the mean."""
    stdout = _run(cluster, Path(__file__).parent.parent / "examples" / "rl.py", "2")
    lines = _matches(r"step +(\d+) +mean reward (\S+) +best (\S+)", stdout)
    assert [int(m.group(1)) for m in lines] == [0, 1], stdout
    for m in lines:
        mean, best = float(m.group(2)), float(m.group(3))
        assert 0.0 <= mean <= best <= 1.0, stdout
