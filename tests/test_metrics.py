"""The coordinator's Prometheus endpoint: scraped while a run trains, its counters follow the work done."""

from __future__ import annotations

import json
import logging
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

import bios
from bios import messages as m
from bios import types
from bios.coordinator.metrics import CoordinatorMetrics, JsonLogFormatter, op_name, split_address
from bios.exceptions import BadRequestError
from bios.sdk import LocalCluster

BASE = "bios/tiny-llama"


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the endpoint, keyed by (name, sorted labels)."""
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def datum(text: str) -> types.Datum:
    tokens = list(text.encode())
    return types.Datum(types.ModelInput.from_ints(tokens[:-1]),
                       {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def test_metrics_follow_training_and_sampling():
    batch = [datum("Metrics count what the cluster does."), datum("Every token is counted.")]
    batch_tokens = sum(d.model_input.length for d in batch)
    # A long heartbeat timeout: on a busy machine a starved worker must not be declared dead mid-test.
    with LocalCluster(metrics="127.0.0.1:0", heartbeat_timeout_s=60) as cluster, \
            bios.ServiceClient(cluster=cluster) as service:
        assert cluster.metrics_url is not None and cluster.metrics_url.endswith("/metrics")
        tc = service.create_lora_training_client(BASE, rank=4, seed=0)
        for _ in range(2):
            tc.forward_backward(batch, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(120)
        during = scrape(cluster.metrics_url)

        for _ in range(3):
            tc.forward_backward(batch, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(120)
        bad = types.Datum(types.ModelInput.from_ints([1, 2, 3]), {"target_tokens": [2, 3], "weights": [1.0, 1.0]})
        with pytest.raises(BadRequestError):
            tc.forward_backward([bad], "cross_entropy").result(120)
        sampler = tc.save_weights_and_get_sampling_client("metrics")
        prompt = types.ModelInput.from_ints(list(b"Metrics"))
        sampled = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=5, temperature=0.0)).result(120)
        after = scrape(cluster.metrics_url)

    def value(samples, name, **labels):
        return samples.get((name, tuple(sorted(labels.items()))), 0.0)

    def cycles(samples):
        return value(samples, "bios_cycles_total", outcome="committed")

    fb_count = ("bios_request_duration_seconds_count", {"op": "forward_backward"})
    assert value(during, fb_count[0], **fb_count[1]) == 2
    assert value(after, fb_count[0], **fb_count[1]) == 5
    assert value(after, "bios_request_duration_seconds_count", op="optim_step") == 5
    assert value(after, "bios_request_duration_seconds_sum", op="forward_backward") > 0
    assert value(after, "bios_requests_total", op="forward_backward", outcome="ok") == 5
    assert value(after, "bios_requests_total", op="create_model", outcome="ok") == 1
    assert value(after, "bios_requests_total", op="forward_backward", outcome="rejected") == 1
    assert cycles(during) >= 2 and cycles(after) >= cycles(during) + 3
    assert value(after, "bios_cycle_duration_seconds_count") == cycles(after)
    assert value(during, "bios_tokens_total", op="forward_backward") == 2 * batch_tokens
    assert value(after, "bios_tokens_total", op="forward_backward") == 5 * batch_tokens
    generated = len(sampled.sequences[0].tokens)
    assert value(after, "bios_tokens_total", op="sample") == prompt.length + generated
    assert value(after, "bios_workers", state="active") == 1
    assert value(after, "bios_queue_depth", pool=BASE) == 0
    assert 0 < value(after, "bios_busy_fraction") <= 1


def test_each_coordinator_has_its_own_registry():
    first, second = CoordinatorMetrics(), CoordinatorMetrics()
    first.cycle_ran(0.5, aborted=False)
    assert b"bios_cycles_total" in second.exposition()
    assert b'bios_cycles_total{outcome="committed"} 1.0' in first.exposition()
    assert b'bios_cycles_total{outcome="committed"} 1.0' not in second.exposition()


def test_failed_request_is_counted_and_logged_with_its_ids(caplog):
    metrics = CoordinatorMetrics()
    op = m.OptimStep("sess:train:0", 3, types.AdamParams())
    metrics.request_accepted("sess:train:0#3", op)
    with caplog.at_level(logging.WARNING, logger="bios.coordinator.metrics"):
        metrics.request_finished("sess:train:0#3", op, None, "adapter missing")
    assert b'bios_requests_total{op="optim_step",outcome="error"} 1.0' in metrics.exposition()
    record = caplog.records[-1]
    assert (record.run_id, record.request_id, record.op) == ("sess:train:0", "sess:train:0#3", "optim_step")
    line = json.loads(JsonLogFormatter("coordinator").format(record))
    assert line["request_id"] == "sess:train:0#3" and line["run_id"] == "sess:train:0"
    assert line["level"] == "warning" and "adapter missing" in line["msg"]


def test_op_names_and_addresses():
    assert op_name(m.ForwardBackward("r", 1, [], "cross_entropy")) == "forward_backward"
    assert op_name(m.ForwardBackward("r", 1, [], "cross_entropy", forward_only=True)) == "forward"
    assert op_name(m.OptimStep("r", 1, types.AdamParams())) == "optim_step"
    assert split_address("127.0.0.1:0") == ("127.0.0.1", 0)
    assert split_address("[::1]:9600") == ("::1", 9600)
    assert split_address(":9600") == ("127.0.0.1", 9600)
    with pytest.raises(ValueError, match="HOST:PORT"):
        split_address("localhost")
