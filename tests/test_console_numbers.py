"""The console's numbers, read back from a real headless Chromium driven over the DevTools protocol.

A run on `bios/tiny-llama` trains with cross_entropy weights scaled per step, so its losses (weighted sums)
span 1e-5 to about 1e5; a second run trains plainly. Every number the run page, the runs table, the chart
ticks and the hover show is parsed back and must equal the recorded value at the precision the console's rule
gives it (`formatNumber` in console.js). The formatter itself is checked over thousands of values in the page.
The compare view overlays both runs. `BIOS_CONSOLE_SHOTS=DIR` also saves the pages as PNGs there.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import os
import random
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import BASE, text_datum

import bios
from bios import types as t

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
WEIGHTS = [1e-7, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0, 8.0, 40.0, 650.0]  # loss:sum ~ 150 x weight
METADATA = {"experiment": "weight-span", "dataset": "numbers"}  # shown on the run page
SHOWN = re.compile(r"-?(\d{1,3}(,\d{3})*|\d+\.\d+|\d(\.\d+)?e-?\d+)")  # the formatter's grammar


# ------------------------------------------------------------------------------------------ the rule

def shown_precision(text: str) -> float:
    """Half a unit of the last digit the rule keeps for a shown number: it is at most this far from the truth."""
    if "e" in text:
        return 0.5 * 10 ** (int(text.split("e")[1]) - 3)
    value = abs(float(text.replace(",", "")))
    if value >= 1000 or value == 0:
        return 0.5
    return 0.5 * 10 ** (math.floor(math.log10(value)) - 3)


def assert_shown(text: str, true: float | None, where: str) -> None:
    """`text` is how the console shows `true`: the rule's grammar, and equal to it at the shown precision."""
    if true is None:
        assert text == "-", f"{where}: {text!r} shown for a missing value"
        return
    assert text == "0" if true == 0 else SHOWN.fullmatch(text), f"{where}: {text!r} is not a formatted number"
    shown = float(text.replace(",", ""))
    assert abs(shown - true) <= shown_precision(text) * (1 + 1e-9), f"{where}: {text!r} shown for {true!r}"
    if "," not in text and "e" not in text and abs(true) < 999.95:
        assert len(text.lstrip("-0.").replace(".", "")) <= 4, f"{where}: {text!r} has more than 4 significant digits"


# ------------------------------------------------------------------------------------------ the browser

class Page:
    """One headless Chromium tab driven over the DevTools protocol (aiohttp's websocket client)."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.next_id = 0

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        await self.ws.send_json({"id": self.next_id, "method": method, "params": params})
        while True:
            message = json.loads((await self.ws.receive()).data)
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    async def eval(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression[:80]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def open(self, url: str, ready: str) -> None:
        """Go to `url` and wait for `ready`."""
        await self.send("Page.navigate", url=url)
        await self.wait(ready)

    async def wait(self, ready: str) -> None:
        """Wait until the console has drawn and `ready` (a CSS selector) is on the page."""
        check = f"document.getElementById('view')?.dataset.ready === '1' && !!document.querySelector({ready!r})"
        for _ in range(600):
            if await self.eval(check):
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"the console never showed {ready}: {await self.eval('document.body.innerText')}")

    async def hover(self, selector: str, index: int = 0) -> None:
        """Move the mouse to the centre of the `index`th element `selector` matches."""
        x, y = await self.eval(f"(() => {{ const r = document.querySelectorAll({selector!r})[{index}]"
                               f".getBoundingClientRect(); return [r.left + r.width / 2, r.top + r.height / 2]; }})()")
        await self.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)

    async def screenshot(self, name: str) -> None:
        """Save the page as BIOS_CONSOLE_SHOTS/name when that variable names a folder."""
        folder = os.environ.get("BIOS_CONSOLE_SHOTS")
        if folder:
            shot = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
            Path(folder, name).write_bytes(base64.b64decode(shot["data"]))


def in_browser(tmp_path: Path, work: Any) -> Any:
    """Start Chromium on a free port (it writes the port to its profile), run `work(page)`, stop Chromium."""
    if CHROMIUM is None:
        pytest.fail("these tests need a headless Chromium: apt-get install -y chromium (.ci/run does)")
    profile = tmp_path / f"profile-{time.monotonic_ns()}"
    browser = subprocess.Popen(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", f"--user-data-dir={profile}",
         "--window-size=1400,1000", "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        port_file = profile / "DevToolsActivePort"
        for _ in range(1200):
            if port_file.exists() and port_file.read_text().count("\n") >= 1:
                break
            assert browser.poll() is None, browser.stderr.read().decode()[-2000:]
            time.sleep(0.1)
        return asyncio.run(_drive(port_file.read_text().split()[0], work))
    finally:
        browser.terminate()
        try:
            browser.wait(30)
        except subprocess.TimeoutExpired:
            browser.kill()
            browser.wait()
        browser.stderr.close()


async def _drive(port: str, work: Any) -> Any:
    """Attach to Chromium's first tab and run `work(page)` on it."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/json/list") as listing:
            target = next(p for p in await listing.json() if p["type"] == "page")
        async with session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            page = Page(ws)
            await page.send("Page.enable")
            await page.send("Emulation.setDeviceMetricsOverride", width=1400, height=1000,
                            deviceScaleFactor=1, mobile=False)
            return await work(page)


# ------------------------------------------------------------------------------------------ the runs

@dataclass
class Runs:
    url: str
    wide: str  # losses from ~1e-5 to ~1e5
    plain: str
    losses: dict[int, float]  # the wide run's loss:sum per step, as forward_backward returned it


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    with bios.LocalCluster(state_dir=tmp_path_factory.mktemp("console-numbers"), http="127.0.0.1:0",
                           worker_threads=1) as cluster, \
            bios.ServiceClient(address=cluster.address, connect_timeout_s=20) as service:
        wide = service.create_lora_training_client(BASE, rank=4, seed=1, user_metadata=METADATA)
        losses = {}
        for step, weight in enumerate(WEIGHTS, start=1):
            out = wide.forward_backward([text_datum("numbers the console must show right", weight)]).result(120)
            losses[step] = out.metrics["loss:sum"]
            wide.optim_step(t.AdamParams(learning_rate=1e-5)).result(120)
        plain = service.create_lora_training_client(BASE, rank=8, seed=2)
        for _ in range(7):
            plain.forward_backward([text_datum("a plain run to compare with")] * 2)
            stepped = plain.optim_step(t.AdamParams(learning_rate=1e-2))
        stepped.result(120)
        yield Runs(cluster.http_url + "/", wide.model_id, plain.model_id, losses)


async def _cells(page: Page, selector: str) -> list[list[str]]:
    return await page.eval(f"[...document.querySelectorAll({selector!r})].map(r =>"
                           f" [...r.children].map(c => c.textContent))")


async def _narrow(page: Page) -> dict[str, bool]:
    """In a 700-pixel window, whether the page stays within it and the steps table scrolls inside its box."""
    await page.send("Emulation.setDeviceMetricsOverride", width=700, height=1000, deviceScaleFactor=1, mobile=False)
    await page.wait("#steps")
    seen = await page.eval("({page: document.documentElement.scrollWidth <= window.innerWidth,"
                           " steps: (b => b.scrollWidth > b.clientWidth)(document.getElementById('steps').parentElement)})")
    await page.send("Emulation.setDeviceMetricsOverride", width=1400, height=1000, deviceScaleFactor=1, mobile=False)
    return seen


# ------------------------------------------------------------------------------------------ tests

def test_the_formatter_over_many_values(runs, tmp_path):
    rng = random.Random(0)
    values = [10 ** rng.uniform(-12, 18) * rng.choice((1, -1)) for _ in range(4000)]
    values += [rng.randint(0, 10 ** rng.randint(1, 14)) for _ in range(1000)]
    values += [0, 0.001, 0.00099996, 0.00099994, 999.94, 999.96, 1000, 1100, 1230.2, 5720, 99999, 99999.5,
               1e15 - 1, 1e15, 1.5e-300, 1.7e308, -0.5, 12.3456, 1 / 3]

    async def work(page: Page) -> list[str]:
        await page.open(runs.url, "#runs")
        return await page.eval(f"{json.dumps(values)}.map(formatNumber)")

    shown = in_browser(tmp_path, work)
    for value, text in zip(values, shown, strict=True):
        assert_shown(text, value, f"formatNumber({value!r})")
    table = dict(zip(values[-19:], shown[-19:]))
    assert [table[v] for v in (1230.2, 1100, 5720, 99999, 0.001, 0.00099996, 999.96, 12.3456)] == \
        ["1,230", "1,100", "5,720", "99,999", "0.001", "1e-3", "1,000", "12.35"]


def test_every_number_on_the_run_page_reads_back_true(runs, tmp_path):
    async def work(page: Page) -> dict[str, Any]:
        await page.open(runs.url, f'tr.run[data-run="{runs.wide}"]')
        listed = await _cells(page, f'tr.run[data-run="{runs.wide}"]')
        await page.open(f"{runs.url}#/run/{runs.wide}", "#steps")
        api = await page.eval(f"api('runs/{runs.wide}')")
        ticks = await page.eval("[...document.querySelectorAll('#chart-loss text.y-tick')].map(t => t.textContent)")
        hovers = []
        for i in range(len(api["points"])):
            await page.hover("#chart-loss circle.pt", i)
            hovers.append(await page.eval("[...document.querySelectorAll('#chart-loss .tip b, #chart-loss .tip-value')]"
                                          ".map(t => t.textContent)"))
        await page.screenshot("console-run-hover.png")
        return {"listed": listed[0], "api": api, "ticks": ticks, "hovers": hovers,
                "summary": dict(await _cells(page, "#summary tr")), "config": dict(await _cells(page, "#config tr")),
                "metadata": dict(await _cells(page, "#user-metadata tr")), "narrow": await _narrow(page),
                "steps": await _cells(page, "#steps tbody tr"),
                "heads": await page.eval("[...document.querySelectorAll('#steps th')].map(t => t.textContent)")}

    seen = in_browser(tmp_path, work)
    points = {p["step"]: p for p in seen["api"]["points"]}
    assert {step: p["loss"] for step, p in points.items()} == runs.losses  # the history is what training returned
    assert min(runs.losses.values()) < 1e-3 and max(runs.losses.values()) > 9e4

    # the runs table: steps, tokens, last loss
    last = points[max(points)]
    for text, true in zip(seen["listed"][4:7], (last["step"], last["total_tokens"], last["loss"]), strict=True):
        assert_shown(text, true, "runs table")
    # the summary and the config
    for name, true in (("steps", last["step"]), ("tokens", last["total_tokens"]), ("last loss", last["loss"]),
                       ("last loss per token", last["loss"] / last["tokens"])):
        assert_shown(seen["summary"][name], true, f"summary {name}")
    assert seen["narrow"] == {"page": True, "steps": True}, "a wide table ran off the page"
    assert seen["config"]["lora rank"] == "4" and seen["config"]["base model"] == BASE
    assert seen["config"]["optimizer"] == "adamw" and seen["metadata"] == METADATA
    # the steps table: every cell but the time
    heads = seen["heads"]
    assert heads[:6] == ["step", "loss:sum", "loss / token", "tokens", "grad norm", "learning rate"]
    assert len(seen["steps"]) == len(points)
    for row in seen["steps"]:
        p = points[int(row[0].replace(",", ""))]
        true = [p["step"], p["loss"], p["loss"] / p["tokens"], p["tokens"], p["grad_norm"], p["learning_rate"],
                *(p["metrics"].get(name) for name in heads[6:-1])]
        for head, text, value in zip(heads[:-1], row[:-1], true, strict=True):
            assert_shown(text, value, f"step {p['step']} {head}")
    # the loss chart's axis spans every loss, and hovering each step names it and its loss
    ticks = [float(tick.replace(",", "")) for tick in seen["ticks"]]
    for tick in seen["ticks"]:
        assert SHOWN.fullmatch(tick) or tick == "0", tick
    assert ticks == sorted(ticks) and ticks[0] <= min(runs.losses.values()) and ticks[-1] >= max(runs.losses.values())
    for (step, loss), hover in zip(sorted(runs.losses.items()), seen["hovers"], strict=True):
        assert hover[0] == f"step {step}"
        assert_shown(hover[1], loss, f"hover at step {step}")


def test_compare_overlays_two_runs_with_smoothing_and_log_scale(runs, tmp_path):
    async def work(page: Page) -> dict[str, Any]:
        await page.open(runs.url, "#runs")
        for run in (runs.wide, runs.plain):
            await page.eval(f"document.querySelector('tr.run[data-run=\"{run}\"] input.pick').click()")
        await page.eval("document.getElementById('compare').click()")
        await page.wait("#compare-config")
        await page.eval("(() => { const s = document.getElementById('smoothing'); s.value = '0.6';"
                        " s.dispatchEvent(new Event('input')); s.dispatchEvent(new Event('change')); })()")
        await page.eval("document.getElementById('log-y').click()")
        await page.wait("#log-y:checked")
        await page.wait("#chart-loss-per-token polyline.raw")
        await page.hover("#chart-loss-per-token svg")
        await page.screenshot("console-compare.png")
        return {"hash": await page.eval("decodeURIComponent(location.hash)"),
                "lines": await page.eval("[...document.querySelectorAll('#chart-loss-per-token polyline.line')]"
                                         ".map(l => l.dataset.series)"),
                "tip": await page.eval("[...document.querySelectorAll('#chart-loss-per-token .tip-row')]"
                                       ".map(r => r.textContent)"),
                "config": await _cells(page, "#compare-config tbody tr"),
                "scrolls": await page.eval("document.documentElement.scrollWidth <= window.innerWidth")}

    seen = in_browser(tmp_path, work)
    assert seen["hash"] == f"#/compare/{runs.wide},{runs.plain}"
    assert seen["lines"] == [runs.wide, runs.plain]
    assert len(seen["tip"]) == 2 and all("smoothed" in row for row in seen["tip"])
    rank = next(row for row in seen["config"] if row[0] == "lora rank")
    assert rank[1:] == ["4", "8"]
    assert seen["scrolls"], "the page is wider than the window: a table ran off it"
