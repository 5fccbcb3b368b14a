"""Shared fixtures: one embedded cluster per test session (starting workers costs seconds), tiny batches."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from contextlib import contextmanager

import numpy as np
import pytest

# Every process the tests start (coordinators, workers) writes built-in models into a private cache, removed at
# the end of the session unless the caller chose the directory.
_PRIVATE_CACHE = "BIOS_CACHE_DIR" not in os.environ
os.environ.setdefault("BIOS_CACHE_DIR", tempfile.mkdtemp(prefix="bios-test-cache-"))
os.environ.setdefault("BIOS_LOG_LEVEL", "INFO")
# One intra-op thread, here and in every worker the tests start: on a shared 2-core machine, OpenMP threads
# spinning at barriers while another process holds the other core make each tiny op hundreds of times slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Exactness tests compare with fp32 references; the bf16 default is tested in tests/test_kernel_integration.py.
os.environ.setdefault("BIOS_BASE_DTYPE", "float32")

import torch  # noqa: E402

import bios  # noqa: E402
from bios import types  # noqa: E402
from bios.kernels import c_kernels  # noqa: E402

torch.set_num_threads(1)

BASE = "bios/tiny-llama"
COOKBOOK_MODEL = "Qwen/Qwen3-8B-Base"  # a name tinker-cookbook knows (role_colon renderer); mapped to BASE


def pytest_sessionfinish(session, exitstatus):
    if _PRIVATE_CACHE:
        shutil.rmtree(os.environ["BIOS_CACHE_DIR"], ignore_errors=True)


# Tests of Bios's C kernels themselves skip where no C compiler builds them (their fallback: test_c_kernels.py).
needs_c_kernels = pytest.mark.skipif(c_kernels.c_compiler() is None,
                                     reason="no C compiler here: no C kernels (their fallback: tests/test_c_kernels.py)")


@pytest.fixture
def fresh_c_kernels(monkeypatch):
    """Bios's C kernels on (`BIOS_C_KERNELS` unset), loaded afresh for the test and again for the next one."""
    monkeypatch.delenv("BIOS_C_KERNELS", raising=False)
    c_kernels._loaded.cache_clear()
    yield
    c_kernels._loaded.cache_clear()


def text_datum(text: str, weight: float = 1.0) -> types.Datum:
    """Next-token prediction over the bytes of `text` (the tiny models' tokenizer is byte-level)."""
    tokens = list(text.encode())
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [weight] * (len(tokens) - 1)},
    )


def random_llama(vocab: int):
    """A seeded random 2-layer Llama (4 query heads, 2 key/value heads) in eval mode: small enough for exact tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


def train_steps(tc, batch, params, steps):
    """Futures of `steps` x (forward_backward, optim_step), submitted without waiting."""
    futures = []
    for _ in range(steps):
        futures.append(tc.forward_backward(batch))
        futures.append(tc.optim_step(params))
    return futures


def fox_sampler_checkpoint(service, name: str, *, seed: int, steps: int) -> str:
    """The path of a sampler checkpoint of a run trained `steps` steps on one sentence (the OpenAI endpoint's
    tests sample it): its prompt "The quick brown" then continues the sentence."""
    tc = service.create_lora_training_client(BASE, rank=4, seed=seed)
    for _ in range(steps):
        tc.forward_backward([text_datum("The quick brown fox jumps over the lazy dog.")])
        tc.optim_step(types.AdamParams(learning_rate=5e-2))
    return tc.save_weights_for_sampler(name).result(120).path


def saved_adapter(service, tc):
    """The run's adapter tensors, through save_state and the REST download."""
    path = tc.save_state().result(120).path
    return service.create_rest_client().download_checkpoint(path).result().adapter


def assert_same_weights(a, b, tol=1e-5, *, strays=0.0, stray_tol=0.0):
    """Every weight within `tol`, absolute and relative (workers sharding a batch sum in another order), except
    that up to a fraction `strays` of a tensor's elements may differ by up to `stray_tol`."""
    assert a.keys() == b.keys()
    for key in a:
        if not strays:
            np.testing.assert_allclose(a[key], b[key], rtol=tol, atol=tol, err_msg=key)
            continue
        off = np.abs(a[key] - b[key]) > tol + tol * np.abs(b[key])
        assert off.mean() <= strays, f"{key}: {off.sum()} of {off.size} weights differ by more than {tol}"
        np.testing.assert_allclose(a[key], b[key], rtol=0, atol=stray_tol, err_msg=key)


def wait_for_workers(service, n, states=("active", "idle"), timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(w.state in states for w in service.cluster_status().workers) >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"fewer than {n} workers came up")


@contextmanager
def held(process):
    """SIGSTOP `process` (a worker) for the block, SIGCONT on the way out. A cycle sent to a held worker cannot
    end, so requests accepted meanwhile wait for the next cycle: tests order cycles by this, not by time."""
    process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        process.send_signal(signal.SIGCONT)


def accepted(future, timeout=60.0):
    """Block until the coordinator has accepted (validated and queued) the request behind `future`."""
    future._accepted.result(timeout)
    return future


def wait_until_taken(service, timeout=60.0, at_most=0):
    """Until at most `at_most` accepted requests still wait in the scheduler's queues (0: every accepted
    request is in a cycle, or done)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if service.cluster_status().queue_depth <= at_most:
            return
        time.sleep(0.02)
    raise AssertionError("accepted requests never left the queue for a cycle")


def base_loads(cluster, base_model, worker=0):
    """How many times worker `worker` of `cluster` loaded `base_model` (its log says so once per copy held)."""
    log = (cluster.state_dir / f"worker-{worker}.log").read_text()
    return log.count(f"loaded base model {base_model} (")


@pytest.fixture(scope="session")
def mapped(tmp_path_factory) -> dict[str, str]:
    """Names the session cluster maps to model directories (`BIOS_MODEL_MAP`): tiny MoE and GPT-2 models, and
    COOKBOOK_MODEL to the built-in tiny model."""
    from arch_models import write_model

    from bios.models.registry import resolve_model_dir

    root = tmp_path_factory.mktemp("archs")
    archs = {f"test/{arch}": str(write_model(arch, root / arch)) for arch in ("qwen3_moe", "gpt2")}
    return {**archs, COOKBOOK_MODEL: str(resolve_model_dir(BASE))}


@pytest.fixture(scope="session")
def cluster(mapped):
    """One worker, back-to-back cycles, the HTTP gateway (for the tinker and openai SDKs) and the `mapped`
    models."""
    with bios.LocalCluster(cycle_s=0.0, worker_threads=1, http="127.0.0.1:0",
                           env={"BIOS_MODEL_MAP": json.dumps(mapped)}) as c:
        yield c


@pytest.fixture(scope="session")
def service(cluster):
    client = bios.ServiceClient(address=cluster.address)
    yield client
    client.close()


@pytest.fixture(scope="session")
def ticking_cluster():
    """A cluster whose clock ticks twice a second, as a daemon's would (every 10 s by default), and whose worker
    tests may hold (`held`) while they queue requests: its heartbeat timeout is a minute, so a held worker is
    never declared dead."""
    with bios.LocalCluster(cycle_s=0.5, worker_threads=1, heartbeat_timeout_s=60.0) as c:
        yield c


@pytest.fixture(scope="session")
def ticking_service(ticking_cluster):
    client = bios.ServiceClient(address=ticking_cluster.address)
    yield client
    client.close()
