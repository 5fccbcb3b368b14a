"""Load (end to end): 64 concurrent clients x 50 operations against one keyed coordinator and two workers.

Everything resolves, nothing fails but backpressure, the coordinator's memory stays flat, and the summary
(requests, p50/p99 latency, peak coordinator RSS, rejects) is printed. The driver is `bench/load.py`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("bench_load", Path(__file__).parents[1] / "bench" / "load.py")
load = sys.modules["bench_load"] = importlib.util.module_from_spec(_spec)  # registered: it defines dataclasses
_spec.loader.exec_module(load)


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_64_clients_by_50_ops_resolve_with_only_backpressure_and_flat_memory(tmp_path):
    report = load.run_load(clients=64, ops=50, keys=4, workers=2, max_queued=32, state_dir=tmp_path)
    print("\n" + report.summary())
    assert report.requests == 64 * (50 + 1)  # every operation and every run creation came back
    assert set(report.errors) <= {"RateLimitError"}, report.errors  # backpressure is the only error allowed
    assert report.rejects > 0  # 64 clients against a cap of 32 queued requests: backpressure really happened
    assert report.rss_peak < 2 * report.rss_start, report.summary()
