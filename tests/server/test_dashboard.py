"""The operator page's data (`GET /v1/dashboard`): the admission snapshot, the queue and running rows, the block
map and its owners, the rejection ring, the model line and the sparklines' history; and its routes.

Engines here are stepped by hand (no loop thread), so every state is exact: 8-token blocks, and prompts of
40 token ids, so a request with `max_tokens=100` reserves `ceil(140 / 8) = 18` blocks.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from helexa.admission import AdmissionConfig, AdmissionController, AdmissionRejected, Capacity
from helexa.admission.rejections import arithmetic_line
from helexa.engine.engine import Engine
from helexa.engine.interface import EngineCounters
from helexa.engine.view import EngineView
from helexa.kvcache import BlockAllocator, HoldingView, KVSurvey, PrefixCache
from helexa.model.sampling import SamplingParams
from helexa.server.blockmap import expected_counts, read_block_map, runs
from helexa.server.dashboard import History, build_dashboard
from helexa.server.settings import ServerSettings
from tests.support.engines import drive, make_engine, torch_threads
from tests.support.servers import RunningServer, tiny_engine_config

LONG = dict(ignore_eos=True)


def _tables(engine) -> dict[str, set[int]]:
    """Each running request's table, by request id, from the KV owner."""
    return {h.key: set(h.block_ids) for h in engine.kv.survey().holdings if h.running}


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


def _prompt(start: int) -> list[int]:
    return list(range(start, start + 40))


def _submit(engine: Engine, start: int, max_tokens: int, request_id: str, session: str | None = None):
    params = SamplingParams(max_tokens=max_tokens, **LONG)
    return engine.submit(_prompt(start), params, request_id=request_id, prompt_cache_key=session)


def _cells(data: dict[str, Any], state: str) -> set[int]:
    return {i for i, c in enumerate(data["blocks"]["cells"]) if c == state}


def _blocks_of(owner: dict[str, Any]) -> set[int]:
    r = owner["runs"]
    return {b for start, n in zip(r[::2], r[1::2]) for b in range(start, start + n)}


def _check_map(engine: Engine, data: dict[str, Any]) -> None:
    """What every reading must satisfy: the snapshot is `/v1/admission`'s, and the map counts follow it."""
    assert data["admission"] == engine.snapshot()
    assert data["blocks"]["exact"]
    assert data["blocks"]["counts"] == expected_counts(data["admission"])
    assert len(data["blocks"]["cells"]) == data["admission"]["blocks_total"]
    json.dumps(data)  # the route sends it as JSON


def test_runs_encode_sorted_block_ids() -> None:
    assert runs([5, 1, 2, 3, 9, 10, 2]) == [1, 3, 5, 1, 9, 2]
    assert runs([]) == []


def test_the_incident_as_data(tiny_model_dir: Path) -> None:
    """Two running, one queued, one refused for a full queue, one that can never fit: every number is the
    snapshot's; in-use cells are exactly the running tables' blocks; the reserved cells are the blocks the
    next allocations take; each rejection keeps what the client was told and the arithmetic."""
    engine = make_engine(tiny_model_dir, num_blocks=48, max_queue_depth=1, max_wait_secs=600.0)
    _submit(engine, 20, 100, "a", session="agent-1")
    _submit(engine, 100, 100, "b")
    for _ in range(4):
        engine.step()
    _submit(engine, 180, 100, "c")  # 18 blocks needed, 12 available: waits
    with pytest.raises(AdmissionRejected) as full:
        _submit(engine, 240, 100, "d")
    with pytest.raises(AdmissionRejected) as never:
        _submit(engine, 300, 1000, "e")  # 130 blocks: more than the pool

    data = build_dashboard(engine)
    _check_map(engine, data)
    snap = data["admission"]
    assert (snap["in_flight"], snap["queue_depth"], snap["blocks_reserved"]) == (2, 1, 36)

    tables = _tables(engine)
    assert _cells(data, "u") == tables["a"] | tables["b"] and len(_cells(data, "u")) == snap["blocks_in_use"]
    free = engine.kv.survey().cache.free
    pending = snap["blocks_reserved"] - snap["blocks_in_use"]
    assert _cells(data, "r") == set(free[len(free) - pending :])
    owners = {o["id"]: o for o in data["blocks"]["owners"]}
    assert set(owners) == {"a", "b"} and owners["a"]["session"] == "agent-1" and owners["b"]["session"] is None
    assert {k: _blocks_of(o) for k, o in owners.items()} == tables

    (queued,) = data["queue"]
    assert (queued["position"], queued["id"], queued["prompt_tokens"], queued["max_tokens"]) == (1, "c", 40, 100)
    assert queued["blocks_needed"] == 18 and queued["est_start_s"] > 0 and 590 < queued["deadline_s"] <= 600
    assert [r["id"] for r in data["running"]] == ["a", "b"]
    for row in data["running"]:
        assert row["prompt_prefilled"] == 40 and 0 < row["tokens_generated"] <= 4
        assert row["blocks_reserved"] == 18 and row["table_blocks"] == len(tables[row["id"]])

    unservable, queue_full = data["rejections"]  # newest first
    for row, exc, status, code, rid in ((unservable, never.value, 400, "context_length_exceeded", "e"),
                                        (queue_full, full.value, 429, "queue_full", "d")):  # fmt: skip
        assert (row["reason"], row["status"], row["code"], row["request_id"]) == (exc.reason, status, code, rid)
        assert (row["retry_after"], row["message"]) == (exc.retry_after, exc.message)
        assert row["arithmetic"] == arithmetic_line(exc.arithmetic)
        assert abs(row["at"] - time.time()) < 60
    assert unservable["retry_after"] is None and queue_full["retry_after"] >= 1
    assert "blocks_needed=130" in unservable["arithmetic"] and "blocks_total=48" in unservable["arithmetic"]

    model = data["model"]
    assert (model["state"], model["fault_cause"], model["device"], model["dtype"]) == ("loaded", None, "cpu", "float32")
    assert "= 48 blocks" in model["budget"]

    # The reserved cells were a prediction: the blocks the running requests take next are among them.
    reserved, grown = _cells(data, "r"), set()
    for _ in range(20):  # a new block every 8 tokens
        engine.step()
        after = _tables(engine)
        grown = set().union(*(after[k] - tables[k] for k in ("a", "b")))
        if len(grown) >= 2:
            break
    assert len(grown) >= 2 and grown <= reserved


def test_cached_and_retained_blocks_with_their_session(tiny_model_dir: Path) -> None:
    """After two requests end, their blocks are cached; the agent session's are retained, named by the session,
    and a reservation larger than the free stack is drawn on cached blocks first, retained ones last."""
    engine = make_engine(tiny_model_dir, num_blocks=48)
    handles = [_submit(engine, 20, 60, "a", session="agent-1"), _submit(engine, 100, 60, "b")]
    drive(engine, handles)
    data = build_dashboard(engine)
    _check_map(engine, data)
    snap = data["admission"]
    assert snap["blocks_in_use"] == 0 and snap["blocks_retained"] == 12 and snap["blocks_cached"] == 24
    (session,) = data["blocks"]["owners"]
    assert (session["kind"], session["id"]) == ("session", "agent-1")
    assert _blocks_of(session) == _cells(data, "s") and len(_cells(data, "s")) == 12
    assert len(_cells(data, "c")) == 12 and data["running"] == [] and data["queue"] == []

    # A new request reserving 30 blocks: 24 empty ones are not enough, so 6 cached blocks will be evicted for
    # it — the least recently used unretained ones — and the map says so before anything is allocated.
    cached_before = _cells(data, "c")
    _submit(engine, 200, 200, "c")  # granted at once; nothing allocated until the engine's next step
    data = build_dashboard(engine)
    _check_map(engine, data)
    assert len(_cells(data, "r")) == 30 and _cells(data, "e") == set()
    assert len(_cells(data, "s")) == 12 and len(cached_before - _cells(data, "c")) == 6
    lru = engine.kv.prefix_cache.survey().evictable[:6]  # what eviction will take
    assert cached_before - _cells(data, "c") == set(lru)


def test_without_a_prefix_cache(tiny_model_dir: Path) -> None:
    """No cached or retained cells; in use is the running table, reserved the top of the free stack."""
    engine = make_engine(tiny_model_dir, num_blocks=32, prefix_cache=False)
    _submit(engine, 20, 100, "a")
    engine.step()
    data = build_dashboard(engine)
    _check_map(engine, data)
    (ids,) = _tables(engine).values()
    assert _cells(data, "u") == ids and _cells(data, "c") == _cells(data, "s") == set()
    assert len(_cells(data, "r")) == 18 - len(ids) and len(_cells(data, "e")) == 32 - 18


def test_poisoned_and_reloading(tiny_model_dir: Path) -> None:
    """A poisoned model shows its cause; while reloading (no pool) the map follows the snapshot's counts and
    keeps the reservations that survive the reload."""
    engine = make_engine(tiny_model_dir, num_blocks=32)
    _submit(engine, 20, 100, "a")
    engine.step()
    engine.kv.reset(None)  # the window of a reload, as `Engine._on_device_fault` opens it: the old pool is gone
    engine.runner = None
    data = build_dashboard(engine)
    assert data["blocks"]["exact"] and data["blocks"]["counts"] == expected_counts(data["admission"])
    assert data["blocks"]["counts"]["reserved"] == 18 and data["model"]["budget"] is None

    engine.health.give_up("device fault not recovered after 3 reloads: RuntimeError: injected device fault")
    data = build_dashboard(engine, budget_line="kv budget: kept")
    assert data["model"]["state"] == data["admission"]["model_state"] == "poisoned"
    assert data["model"]["fault_cause"].endswith("injected device fault")
    assert data["model"]["budget"] == "kv budget: kept"


def test_rejection_ring_is_bounded_and_keeps_the_newest() -> None:
    """The controller keeps the newest `recent_rejections`, oldest first, each with its log line's arithmetic."""
    config = AdmissionConfig(max_num_seqs=2, max_queue_depth=4, max_wait_secs=10.0)
    controller = AdmissionController(config, Capacity(16, 8, 128), recent_rejections=3)
    for prompt in range(200, 205):  # beyond max_model_len: refused for good
        with pytest.raises(AdmissionRejected):
            controller.submit(prompt, 10, request_id=f"r{prompt}")
    kept = controller.recent_rejections()
    assert [r.arithmetic["prompt"] for r in kept] == [202, 203, 204]
    assert [r.request_id for r in kept] == ["r202", "r203", "r204"]
    assert all(r.reason == "kv_unservable" and r.retry_after is None for r in kept)
    assert kept[-1].line.startswith("prompt=204 max_tokens=10 shared_blocks=0 blocks_needed=14 ")
    assert kept[-1].line == arithmetic_line(kept[-1].arithmetic)
    assert controller.snapshot()["rejected"]["kv_unservable"] == 5
    view = controller.view()
    assert view.rejections == kept and view.waiting == view.running == []

    silent = AdmissionController(config, Capacity(16, 8, 128), recent_rejections=0)
    with pytest.raises(AdmissionRejected):
        silent.submit(300, 10)
    assert silent.recent_rejections() == [] and silent.snapshot()["rejected"]["kv_unservable"] == 1


def test_history_points_are_rates_per_interval() -> None:
    """Each point is one interval's tokens per second and mean step time (None without steps)."""
    counters, now = EngineCounters(), [1000.0]
    history = History(SimpleNamespace(counters=counters), interval=1.0, clock=lambda: now[0])
    history.sample()
    counters.generation_tokens, counters.prompt_tokens, counters.steps, counters.step_seconds = 50, 200, 10, 0.2
    now[0] += 2.0
    history.sample()
    now[0] += 1.0
    history.sample()  # idle second
    first, idle = history.points()
    assert (first["generation_tps"], first["prompt_tps"], first["steps_per_s"]) == (25.0, 100.0, 5.0)
    assert first["step_ms"] == pytest.approx(20.0) and first["t"] == 1002.0
    assert (idle["generation_tps"], idle["step_ms"]) == (0.0, None)


@pytest.mark.alone  # measures time: the read must take under 0.5 s
def test_a_map_of_100k_blocks_is_cheap_to_read() -> None:
    """The map of a 100,000-block pool (60k in use, 20k cached of which 5k retained) reads in well under a
    poll interval, and its counts follow the snapshot's."""
    allocator = BlockAllocator(100_000, "cpu")
    cache = PrefixCache(allocator, block_size=1)
    ids = allocator.allocate(80_000).tolist()
    parent = None
    for i, b in enumerate(ids[:20_000]):
        parent = cache.insert(b, [i], parent, owner="x")
    cache.release(ids[:15_000], owner="x")
    cache.release(ids[15_000:20_000], owner="x", session="agent-9")
    counts = cache.counts()
    snapshot = {
        "blocks_total": 100_000,
        "blocks_empty": counts.empty,
        "blocks_cached": counts.cached,
        "blocks_retained": counts.retained,
        "blocks_in_use": counts.in_use,
        "blocks_reserved": counts.in_use + 30_000,
    }
    t0 = time.perf_counter()
    holding = HoldingView("big", None, tuple(ids[20_000:]), 60_000, True)
    view = EngineView(None, snapshot, KVSurvey(cache.survey(), [holding]), None)  # type: ignore[arg-type]
    blocks = read_block_map(view)
    seconds = time.perf_counter() - t0
    assert blocks.exact and blocks.counts == expected_counts(snapshot)
    assert blocks.counts == {"in_use": 60_000, "reserved": 30_000, "empty": 0, "cached": 5_000, "retained": 5_000}
    assert seconds < 0.5, seconds  # ~0.03 s on a laptop
    big = next(o for o in blocks.owners if o["id"] == "big")
    assert runs(ids[20_000:]) == big["runs"]


def test_routes_and_api_key(tiny_model_dir: Path) -> None:
    """`GET /` and its files are open and load nothing from elsewhere; `/v1/dashboard` needs the key like every
    `/v1/*` route and, on an idle server, carries exactly the `/v1/admission` body."""
    with _server(tiny_model_dir, ServerSettings(api_key="k3y")) as server:
        page = httpx.get(f"{server.url}/", timeout=10)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "default-src 'none'" in page.headers["content-security-policy"]
        assert "connect-src 'self'" in page.headers["content-security-policy"]
        assert 'src="/dashboard/dashboard.js"' in page.text and "http" not in page.text.split("</head>")[0]
        for asset, kind in (("/dashboard/dashboard.js", "javascript"), ("/dashboard/dashboard.css", "css")):
            response = httpx.get(f"{server.url}{asset}", timeout=10)
            assert response.status_code == 200 and kind in response.headers["content-type"]
            assert "https://" not in response.text and "@import" not in response.text
        refused = httpx.get(f"{server.url}/v1/dashboard", timeout=10)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        key = {"Authorization": "Bearer k3y"}
        data = httpx.get(f"{server.url}/v1/dashboard", headers=key, timeout=10)
        assert data.status_code == 200 and data.headers["cache-control"] == "no-store"
        admission = httpx.get(f"{server.url}/v1/admission", headers=key, timeout=10).json()
        assert data.json()["admission"] == admission
        assert data.json()["blocks"]["counts"] == expected_counts(admission)
    with _server(tiny_model_dir, None) as server:  # no key: open, like /metrics
        assert httpx.get(f"{server.url}/v1/dashboard", timeout=10).status_code == 200


@contextlib.contextmanager
def _server(model_dir: Path, settings: ServerSettings | None) -> Iterator[RunningServer]:
    running = RunningServer(tiny_engine_config(model_dir, num_blocks=32), settings)
    try:
        yield running
    finally:
        running.stop()
