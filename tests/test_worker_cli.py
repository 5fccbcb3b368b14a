"""`bios-worker --gpus`: one child per GPU with the rest of the command line, or a clear refusal on CPU."""

from __future__ import annotations

import torch

from bios.cli import worker as worker_main


class FakeChild:
    def __init__(self, args, **_: object) -> None:
        self.args = args

    def wait(self) -> int:
        return 0

    def send_signal(self, signum: int) -> None:
        pass


def test_gpus_all_forks_one_worker_per_device(monkeypatch):
    started = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(worker_main.subprocess, "Popen", lambda args, **kw: started.append(args) or FakeChild(args))
    assert worker_main.main(["--coordinator", "tcp://h:7600", "--gpus", "all", "--threads", "4"]) == 0
    assert [a[-1] for a in started] == ["cuda:0", "cuda:1", "cuda:2"]
    assert all("--gpus" not in a and a[a.index("--coordinator") + 1] == "tcp://h:7600" for a in started)
    assert all(a[a.index("--threads") + 1] == "4" for a in started)


def test_gpus_without_gpus_is_refused_with_a_reason(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert worker_main.main(["--gpus", "all"]) == 2
    assert "0 are visible" in capsys.readouterr().err
