"""The web console in a real browser (headless Chromium): a keyed cluster trains two runs, one per key; the
rendered pages list them (both for the admin key, only its own for a key), draw a loss chart with one
point per step, show the worker as active, and a screenshot of a run page is not blank."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from conftest import BASE, text_datum

import bios
from bios import types as t
from bios.security.keys import KeyStore

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class Trained:
    cluster: bios.LocalCluster
    admin: str  # the admin key: sees every key's runs
    alice: str
    bob: str
    alice_run: str
    bob_run: str


def _train(cluster: bios.LocalCluster, key: str, steps: int) -> str:
    with bios.ServiceClient(address=cluster.address, api_key=key, connect_timeout_s=20) as service:
        tc = service.create_lora_training_client(BASE, rank=4, seed=steps)
        for _ in range(steps):
            tc.forward_backward([text_datum("the console draws this loss")])
            tc.optim_step(t.AdamParams(learning_rate=1e-2))
        tc.save_weights_for_sampler("console").result(120)
        return tc.model_id


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    state_dir = tmp_path_factory.mktemp("console")
    keys, _ = KeyStore.init(state_dir)
    alice, bob = str(keys.create("alice")), str(keys.create("bob"))
    admin = str(keys.admin_key())
    keys.close()
    with bios.LocalCluster(state_dir=state_dir, http="127.0.0.1:0", worker_threads=1) as cluster:
        yield Trained(cluster, admin, alice, bob, _train(cluster, alice, 3), _train(cluster, bob, 2))


def browse(url: str, tmp_path: Path, *, screenshot: Path | None = None) -> str:
    """The DOM Chromium renders at `url` once its scripts have fetched and drawn (a fresh profile each time, so
    no key is remembered from another page)."""
    if CHROMIUM is None:
        pytest.fail("these tests need a headless Chromium: apt-get install -y chromium (.ci/run does)")
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            f"--user-data-dir={profile}", "--virtual-time-budget=5000", "--window-size=1280,1000"]
    args += [f"--screenshot={screenshot}"] if screenshot is not None else ["--dump-dom"]
    done = subprocess.run([*args, url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _page(trained: Trained, key: str, fragment: str = "") -> str:
    return f"{trained.cluster.http_url}/?key={quote(key)}{fragment}"


def _listed_runs(dom: str) -> set[str]:
    return set(re.findall(r'<tr class="run" data-run="([^"]+)"', dom))


def test_admin_sees_both_runs_and_the_active_worker(trained, tmp_path):
    dom = browse(_page(trained, trained.admin), tmp_path)
    assert 'data-ready="1"' in dom
    assert _listed_runs(dom) == {trained.alice_run, trained.bob_run}
    workers = re.findall(r'<tr class="worker".*?</tr>', dom)
    assert len(workers) == 1 and '<td class="state-active">active</td>' in workers[0]
    with bios.ServiceClient(address=trained.cluster.address, api_key=trained.alice, connect_timeout_s=20) as svc:
        status = svc.cluster_status()  # the placement as run, where the console shows it
    worker = status.workers[0]
    assert f'<td class="models">{BASE}</td>' in workers[0] and worker.models == [BASE]
    assert f'<td class="num memory">{worker.memory_bytes / 2**30:.1f} GiB</td>' in workers[0]
    group = re.search(r'<tr class="group".*?</tr>', dom).group(0)
    assert f"<td>{BASE}</td>" in group and '<td class="num tp">1</td>' in group
    assert f"<td>{worker.worker_id}</td>" in group
    pools = re.search(r'<table id="pools">.*?</table>', dom).group(0)
    assert BASE in pools and status.longest_rows[BASE] > 0  # the longest row a worker trains, as planned
    assert f'<td class="num longest-row">{status.longest_rows[BASE]} tokens</td>' in pools
    forward = status.longest_forward_rows[BASE]  # a forward builds no graph: it runs rows at least as long
    assert forward >= status.longest_rows[BASE] and f'<td class="num longest-forward-row">{forward} tokens</td>' in pools


def test_a_key_sees_only_its_runs(trained, tmp_path):
    assert _listed_runs(browse(_page(trained, trained.alice), tmp_path)) == {trained.alice_run}
    assert _listed_runs(browse(_page(trained, trained.bob), tmp_path)) == {trained.bob_run}
    other = browse(_page(trained, trained.bob, f"#/run/{quote(trained.alice_run)}"), tmp_path)
    assert "could not load: no training run" in other and 'id="chart-loss"' not in other


def test_without_a_key_the_console_asks_for_one(trained, tmp_path):
    dom = browse(trained.cluster.http_url + "/", tmp_path)
    assert re.search(r'<form id="login">', dom) and 'data-ready="1"' not in dom
    api = httpx.get(f"{trained.cluster.http_url}/console/api/runs", timeout=30)
    assert api.status_code == 401


def test_a_run_page_charts_one_point_per_step(trained, tmp_path):
    url = _page(trained, trained.alice, f"#/run/{quote(trained.alice_run)}")
    dom = browse(url, tmp_path)
    loss = re.search(r'<div class="chart" id="chart-loss" data-points="(\d+)">(.*?)</div>', dom)
    assert loss is not None and loss.group(1) == "3"
    assert loss.group(2).count('<circle class="pt"') == 3
    assert 'id="chart-grad-norm" data-points="3"' in dom and 'id="chart-lr" data-points="3"' in dom
    assert 'id="chart-tokens-per-s" data-points="2"' in dom  # a rate needs two points
    assert f"bios checkpoint export bios://{trained.alice_run}/sampler_weights/console" in dom

    shot = tmp_path / "run.png"
    browse(url, tmp_path, screenshot=shot)
    from PIL import Image

    with Image.open(shot) as image:
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 20, "the screenshot is blank"


def test_openai_routes_take_keys_as_bearer_tokens(trained):
    url = f"{trained.cluster.http_url}/v1/completions"
    body = {"model": f"bios://{trained.alice_run}/sampler_weights/console", "prompt": "hi", "max_tokens": 2}
    missing = httpx.post(url, json=body, timeout=60)
    assert missing.status_code == 401 and "requires an API key" in missing.json()["error"]["message"]
    assert httpx.post(url, json=body, headers={"Authorization": f"Bearer {trained.bob}"}, timeout=60).status_code == 404
    done = httpx.post(url, json=body, headers={"Authorization": f"Bearer {trained.alice}"}, timeout=120)
    assert done.status_code == 200 and done.json()["choices"][0]["finish_reason"] in ("stop", "length")
