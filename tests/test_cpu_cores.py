"""Workers size their thread pools to the cores they may use (bios.cpu_cores), not to the machine's."""

import os

import pytest

from bios.cpu_cores import threads_per_worker, usable_cores


@pytest.mark.parametrize(("cpu_max", "expected"), [
    ("max 100000\n", None),  # no quota: the affinity mask decides
    ("100000 100000\n", 1),
    ("150000 100000\n", 2),  # 1.5 CPUs of time: two threads, rounded up
    ("not a cgroup file", None),
])
def test_usable_cores_are_the_affinity_mask_capped_by_the_cgroup_quota(tmp_path, cpu_max, expected):
    path = tmp_path / "cpu.max"
    path.write_text(cpu_max)
    mask = len(os.sched_getaffinity(0))
    assert usable_cores(path) == (mask if expected is None else min(mask, expected))
    assert usable_cores(tmp_path / "absent") == mask


def test_workers_on_one_machine_share_its_cores():
    assert threads_per_worker(2, cores=8) == 4
    assert threads_per_worker(3, cores=2) == 1  # never zero
    assert threads_per_worker(1, cores=2) == 2
