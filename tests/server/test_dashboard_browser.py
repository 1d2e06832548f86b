"""The operator page in a real browser: Debian's headless Chromium driven by Playwright, against a real
server on 127.0.0.1 with a tiny model and a 64-block pool.

The scenario is DESIGN.md's incident: two long turns hold most of the pool, a third waits (with its
estimated start), a fourth finds the queue full (429) and a fifth can never fit (400). The engine loop
is held between two steps while the page is checked, so the page and `GET /v1/admission` describe the
same state and can be compared number for number. The screenshot lands in `bench/out/dashboard.png`.

Chromium is the system's (`apt-get install chromium`, which `make test` does as root); Playwright never
downloads a browser here. Without either, these tests skip and say which is missing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from helexa.admission import EngineRates
from helexa.server.blockmap import expected_counts
from helexa.server.settings import ServerSettings
from tests.support.engines import torch_threads
from tests.support.servers import RunningServer, tiny_engine_config, wait_for

REPO = Path(__file__).resolve().parents[2]
SCREENSHOT = REPO / "bench" / "out" / "dashboard.png"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SECRET_WORD = "zebraquokka"  # in a prompt's text: the page and its data must never show it
LONG = {"ignore_eos": True}


def _chromium() -> str | None:
    for candidate in (os.environ.get("HELEXA_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """A headless Chromium (the system's) under Playwright; skips with the reason when either is missing."""
    executable = _chromium()
    if executable is None:
        pytest.skip("no Chromium: install Debian's `chromium` package (make test does, as root) or set HELEXA_CHROMIUM")
    if importlib.util.find_spec("playwright") is None:
        pytest.skip("Playwright for Python is not installed (pip install -e '.[test]')")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


@contextlib.contextmanager
def _serve(model_dir: Path, settings: ServerSettings | None = None, **overrides: Any) -> Iterator[RunningServer]:
    running = RunningServer(tiny_engine_config(model_dir, **overrides), settings)
    try:
        yield running
    finally:
        running.stop()


class _Gate:
    """Holds the engine loop between two steps (nothing in admission or the pool moves while held, except what
    request threads submit); `release()` lets it run on. Always released on exit."""

    def __init__(self, server: RunningServer) -> None:
        self.engine = server.engine
        self.open = threading.Event()
        self.open.set()
        self.parked = threading.Event()
        step = self.engine.step

        def gated_step() -> bool:
            if not self.open.is_set():
                self.parked.set()
                self.open.wait()
                self.parked.clear()
            return step()

        self.engine.step = gated_step
        self._step = step

    def hold(self) -> None:
        self.open.clear()
        assert self.parked.wait(10), "the engine loop did not reach the gate"  # an idle loop wakes every 0.5 s

    def release(self) -> None:
        self.open.set()

    def __enter__(self) -> _Gate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
        self.engine.step = self._step


class _Background:
    """`fn()` in a daemon thread; `result()` joins (bounded) and returns or re-raises."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.value = fn()
        except BaseException as exc:  # handed over by result()
            self.error = exc

    def result(self, timeout: float = 60) -> Any:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"did not finish within {timeout} s"
        if self.error is not None:
            raise self.error
        return self.value


def _stream(url: str, body: dict[str, Any], started: threading.Event) -> int:
    """POST a streamed completion; set `started` at its first token chunk; return how many chunks arrived."""
    chunks = 0
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks += 1
                started.set()
    return chunks


def _admission(url: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    return httpx.get(f"{url}/v1/admission", headers=headers or {}, timeout=10).json()


def _page_numbers(page: Any) -> dict[str, int]:
    """The totals the page shows, by their `/v1/admission` field name (dots: `rejected.queue_full`)."""
    shown = page.eval_on_selector_all("[data-field]", "els => els.map(e => [e.dataset.field, e.textContent])")
    return {name: int(text.replace(",", "")) for name, text in shown}


def _field(snapshot: dict[str, Any], name: str) -> Any:
    for key in name.split("."):
        snapshot = snapshot[key]
    return snapshot


def _drawn_counts(page: Any) -> dict[str, int]:
    names = ("in_use", "reserved", "empty", "cached", "retained")
    return {n: int(page.get_attribute("#map", f"data-count_{n}")) for n in names}


def _until(page: Any, expression: str, timeout: float = 15) -> Any:
    """Poll `expression` in the page until it is truthy; its value. (Playwright's `wait_for_function` evaluates
    a string, which the page's Content-Security-Policy forbids, as it should.)"""
    deadline = time.monotonic() + timeout
    while not (value := page.evaluate(expression)):
        assert time.monotonic() < deadline, f"{expression} stayed falsy for {timeout} s"
        time.sleep(0.05)
    return value


def _wait_for_update(page: Any, after: int = 0) -> int:
    """Wait until the page has drawn an update newer than `after`; its update count."""
    return int(_until(page, f"Number(document.body.dataset.updates || 0) > {after} && document.body.dataset.updates"))


def _data_running(page: Any) -> list[dict[str, Any]]:
    return page.evaluate("window.helexaDashboard.data.running")


def _check_against_snapshot(page: Any, url: str) -> dict[str, Any]:
    """The page's totals and block-map colours equal `GET /v1/admission` now (the state must be still)."""
    updates = int(page.evaluate("document.body.dataset.updates || 0"))
    _wait_for_update(page, updates)  # drawn from a reading taken after the state froze
    snapshot = _admission(url)
    numbers = _page_numbers(page)
    assert len(numbers) >= 15
    assert {name: _field(snapshot, name) for name in numbers} == numbers
    drawn = _drawn_counts(page)
    assert drawn == expected_counts(snapshot)
    assert drawn["in_use"] + drawn["reserved"] == snapshot["blocks_reserved"]
    assert drawn["empty"] + drawn["cached"] + drawn["retained"] == snapshot["blocks_available"]
    assert int(page.get_attribute("#map", "data-blocks")) == snapshot["blocks_total"]
    return snapshot


def test_the_incident_on_the_page(tiny_model_dir: Path, browser: Any) -> None:
    """Two long turns run, a third waits with its estimated start, a fourth gets 429, a fifth 400: the page
    shows each number `/v1/admission` has, colours exactly that many cells, names who holds a hovered
    block, lists both refusals with their arithmetic and Retry-After, and never shows prompt text."""
    rng = random.Random(19)

    def ids() -> list[int]:
        return [rng.randrange(20, 300) for _ in range(10)]

    with _serve(tiny_model_dir, num_blocks=64, max_queue_depth=1, max_num_seqs=4) as server, _Gate(server) as gate:
        url = server.url
        a_started, b_started, c_started = threading.Event(), threading.Event(), threading.Event()
        a_body = {"prompt": f"{SECRET_WORD} plans the garden", "max_tokens": 300, "prompt_cache_key": "agent-7"}
        a = _Background(lambda: _stream(url, {**a_body, **LONG}, a_started))
        b = _Background(lambda: _stream(url, {"prompt": ids(), "max_tokens": 470, **LONG}, b_started))
        assert a_started.wait(20) and b_started.wait(20)
        gate.hold()  # both turns hold their reservations; nothing moves from here
        # A slow decode rate (until the next step measures again), so the third request's estimated start is
        # long and exact: the agent turn's remaining tokens x 0.5 s (ignore_eos: it runs to max_tokens).
        server.engine.admission.set_rates(EngineRates(decode_step_seconds=0.5, prefill_token_seconds=0.001))

        held = _admission(url)
        assert held["in_flight"] == 2 and held["blocks_available"] < 30, held
        c = _Background(lambda: _stream(url, {"prompt": ids(), "max_tokens": 470, **LONG}, c_started))
        assert wait_for(lambda: _admission(url)["queue_depth"] == 1, 10), _admission(url)
        full = httpx.post(f"{url}/v1/completions", json={"prompt": ids(), "max_tokens": 100}, timeout=10)
        assert full.status_code == 429, full.text
        never = httpx.post(f"{url}/v1/completions", json={"prompt": ids(), "max_tokens": 1100}, timeout=10)
        assert never.status_code == 400 and never.json()["error"]["code"] == "context_length_exceeded"

        page = browser.new_page(viewport={"width": 1360, "height": 1000})
        requested: list[str] = []
        page.on("request", lambda r: requested.append(r.url))
        page.goto(f"{url}/")
        _wait_for_update(page)
        snapshot = _check_against_snapshot(page, url)
        assert (snapshot["in_flight"], snapshot["queue_depth"]) == (2, 1)
        assert snapshot["rejected"]["queue_full"] == 1 and snapshot["rejected"]["kv_unservable"] == 1

        # The third request waits: its numbers and an estimated start in the future.
        (row,) = page.query_selector_all("#queue tbody tr")
        cells = [td.inner_text() for td in row.query_selector_all("td")]
        assert cells[0] == "1" and cells[2] == "10" and cells[3] == "470" and cells[4] == str(-(-480 // 16))
        est_start = float(row.query_selector("[data-est-start]").get_attribute("data-est-start"))
        (agent_row,) = (r for r in _data_running(page) if r["session"] == "agent-7")
        left = (agent_row["max_tokens"] - agent_row["tokens_generated"]) * 0.5
        shown = int(est_start + 0.5)  # the page rounds to whole seconds
        assert left - 30 < est_start <= left and cells[6] == f"in {shown // 60} min {shown % 60} s"

        # Running requests with their progress; the first turn's session is named, never its prompt.
        running = [r.inner_text() for r in page.query_selector_all("#running tbody tr")]
        assert len(running) == 2
        (agent,) = (text for text in running if "agent-7" in text)
        assert "/ 300" in agent and "/ 470" not in agent
        data = page.evaluate("window.helexaDashboard.data")
        assert SECRET_WORD not in json.dumps(data) and SECRET_WORD not in page.content()

        # Both refusals, newest first, with the status, Retry-After and arithmetic the client and the log got.
        rows = page.query_selector_all("#rejections tbody tr")
        assert [r.get_attribute("data-reason") for r in rows] == ["kv_unservable", "queue_full"]
        unservable, queue_full = (r.inner_text() for r in rows)
        assert "429 queue_full" in queue_full and f"{full.headers['retry-after']} s" in queue_full
        assert full.json()["error"]["message"] in queue_full
        assert "blocks_needed=7" in queue_full and "blocks_total=64" in queue_full and "queue_depth=1" in queue_full
        assert "400 context_length_exceeded" in unservable and "none (permanent)" in unservable
        assert "blocks_needed=70" in unservable and never.json()["error"]["message"] in unservable

        # Hovering an in-use block names the request that holds it (and its session).
        owner = next(o for o in data["blocks"]["owners"] if o["session"] == "agent-7")
        block = owner["runs"][0]
        lay = page.evaluate(f"window.helexaDashboard.layout({data['admission']['blocks_total']}, "
                            "Math.floor(document.getElementById('map-wrap').clientWidth))")  # fmt: skip
        box = page.query_selector("#map").bounding_box()
        x = box["x"] + (block % lay["cols"]) * lay["size"] + lay["size"] / 2
        y = box["y"] + (block // lay["cols"]) * lay["size"] + lay["size"] / 2
        page.mouse.move(x, y)
        tip = page.inner_text("#tip")
        assert f"block {block} · in use" in tip and owner["id"] in tip and "session agent-7" in tip
        assert page.query_selector(f'#running tr.active[data-owner="{owner["id"]}"]') is not None
        _wait_for_update(page, int(page.evaluate("document.body.dataset.updates")))  # the next poll rebuilds the rows
        assert page.query_selector(f'#running tr.active[data-owner="{owner["id"]}"]') is not None, "highlight lost"

        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOT), full_page=True)
        assert all(u.startswith(url) for u in requested), requested  # nothing from anywhere else (no CDN)

        # Let it run: the third request is admitted when the first turn ends, and everything drains.
        gate.release()
        assert a.result() > 0 and b.result() > 0 and c.result() > 0
        assert wait_for(lambda: _admission(url)["blocks_reserved"] == 0, 10)
        idle = _check_against_snapshot(page, url)
        assert (idle["in_flight"], idle["queue_depth"], idle["blocks_in_use"]) == (0, 0, 0)
        assert idle["blocks_retained"] > 0 and idle["blocks_cached"] > idle["blocks_retained"]  # agent-7's turn
        assert page.query_selector_all("#queue tbody tr") == [] and page.is_visible("#queue-empty")
        points = page.evaluate("window.helexaDashboard.data.series.points")
        assert max(p["generation_tps"] for p in points) > 0 and page.query_selector("#spark-tps polyline")
        page.screenshot(path=str(SCREENSHOT.with_name("dashboard-drained.png")), full_page=True)
        page.close()


def test_api_key_login_keeps_the_key_in_the_session(tiny_model_dir: Path, browser: Any) -> None:
    """With --api-key the page asks for the key, refuses a wrong one, then shows the data; the key stays in
    session storage (a reload needs no login) and goes out only as a Bearer header to this server."""
    with _serve(tiny_model_dir, ServerSettings(api_key="s3cret-key"), num_blocks=32) as server:
        page = browser.new_page()
        auth_headers: list[str | None] = []
        page.on("request", lambda r: auth_headers.append(r.headers.get("authorization")) if "/v1/" in r.url else None)
        page.goto(f"{server.url}/")
        page.wait_for_selector("#login", state="visible")
        assert page.is_hidden("#main")
        page.fill("#key", "wrong")
        page.click("#login button")
        _until(page, "document.getElementById('login-error').textContent.includes('refused')")
        page.fill("#key", "s3cret-key")
        page.click("#login button")
        _wait_for_update(page)
        assert page.is_hidden("#login") and page.is_visible("#main")
        assert _page_numbers(page)["blocks_total"] == 32
        assert page.evaluate("sessionStorage.getItem('helexa.apiKey')") == "s3cret-key"
        page.reload()
        _wait_for_update(page)
        assert page.is_hidden("#login")
        assert auth_headers[0] is None and "Bearer wrong" in auth_headers and auth_headers[-1] == "Bearer s3cret-key"
        page.close()


def test_a_pool_of_100k_blocks_draws_fast(tiny_model_dir: Path, browser: Any) -> None:
    """The block map is one canvas image, not 100k DOM nodes: 100,000 cells draw well within a poll interval,
    and each state's cells are counted as drawn."""
    with _serve(tiny_model_dir, num_blocks=16) as server:
        page = browser.new_page(viewport={"width": 1360, "height": 1000})
        page.goto(f"{server.url}/")
        _wait_for_update(page)
        counts = page.evaluate(
            """() => {
                const parts = [["u", 41000], ["r", 9000], ["e", 30000], ["c", 15000], ["s", 5000]];
                const cells = parts.map(([c, n]) => c.repeat(n)).join("");
                const data = window.helexaDashboard.data;
                const times = [];
                for (let i = 0; i < 3; i++) {
                    const t0 = performance.now();
                    window.helexaDashboard.drawMap({cells, owners: [], counts: {}, exact: true}, data.admission);
                    times.push(performance.now() - t0);
                }
                const map = document.getElementById("map");
                const d = map.dataset;
                return {best: Math.min(...times), in_use: +d.count_in_use, reserved: +d.count_reserved,
                        empty: +d.count_empty, cached: +d.count_cached, retained: +d.count_retained,
                        blocks: +d.blocks, nodes: document.getElementsByTagName("*").length};
            }"""
        )
        assert counts["blocks"] == 100_000
        assert [counts[k] for k in ("in_use", "reserved", "empty", "cached", "retained")] == [
            41000,
            9000,
            30000,
            15000,
            5000,
        ]
        assert counts["best"] < 250, counts  # ms; ~10-30 on a laptop
        assert counts["nodes"] < 1000
        page.close()
