"""The coordinator's clock is visible: logged at start and reported by get_server_capabilities and status, so
a step that waits for the next tick (bios-coordinator's default is every 10 s) says why."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e


def test_capabilities_and_status_report_the_cycle_length(ticking_cluster, ticking_service):
    assert ticking_service.get_server_capabilities().cycle_s == 0.5
    assert ticking_service.cluster_status().cycle_s == 0.5
    assert "cycle length 0.5s (--cycle-s)" in ticking_cluster.log_path("coordinator").read_text()


def test_back_to_back_cycles_say_so(cluster, service):
    assert service.get_server_capabilities().cycle_s == 0.0
    assert "cycle length 0s (--cycle-s): cycles run back to back" in cluster.log_path("coordinator").read_text()
