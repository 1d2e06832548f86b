"""Soak: many concurrent clients, random requests, cancellations, rejections and two injected device faults.

32 client threads send requests (three routes, streaming and not, random prompt and output lengths)
to an in-process server on 127.0.0.1 whose engine faults twice during the run (HELEXA_FAULT_INJECT).
About 20% of the requests are abandoned mid-stream or disconnect before the answer, some can never
fit (400 context_length_exceeded), and the 32 clients outnumber the 8 sequence slots plus the
16-deep queue, so some get 429 queue_full. Beside them a hostile client in another process holds ~300
connections that never finish their request head and keeps posting 7.9 MiB bodies, and a prober reads
`/health` every 50 ms. Every request must end in a complete response or a documented error (its
status, code and Retry-After), within its deadline; `/health` keeps answering. Afterwards no block
is reserved or allocated, every integrity check passes and the process RSS grew less than
`RSS_BOUND_BYTES`.

CI runs 200 requests (~7 s of load, ~15 s with set-up, on two cores); `HELEXA_SOAK=long` (`make soak`)
runs 1,000 (~30 s of load).
"""

from __future__ import annotations

import gc
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from helexa.server.settings import ServerSettings
from tests.support.servers import DOCUMENTED_ERRORS, metric, rss_bytes, serving, wait_for

pytestmark = pytest.mark.alone  # measures time: /health's p99 and each probe are held to bounds

LONG = os.environ.get("HELEXA_SOAK") == "long"
NUM_REQUESTS = 1000 if LONG else 200
NUM_CLIENTS = 32
# After the warm-up (< 30 steps), inside the run: > 600 steps on an idle machine, ~390 on a contended one
# (slower steps batch more requests each).
FAULT_STEPS = "100,2000" if LONG else "100,300"
MAX_MODEL_LEN = 1024
REQUEST_DEADLINE_SECS = 60.0  # no single request may take longer (client read timeout)
SOAK_DEADLINE_SECS = 600.0 if LONG else 180.0  # the whole run
# RSS bound: the tiny model and its 256-block pool are a few MiB and are rebuilt (not added to) on each
# reload, so growth after the warm-up is allocator and interpreter caches settling plus anything a request
# leaves behind. Measured on two cores: 5-23 MiB after 200 requests, 10-47 MiB after 1,000; in rounds of
# 300 requests RSS levels off after ~600 and Python's object count stays flat. 96 MiB is twice the worst
# measurement, and 200 requests each leaking half a MiB (a block table, a detokenizer, a stream's queue)
# would pass it.
RSS_BOUND_BYTES = 96 << 20

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
WORDS = "the sea a ship sails far over waves and wind under stars while gulls cry".split()


@dataclass
class Outcome:
    """How one request ended: `kind` in ok | cancelled | error | bad; `detail` says what was seen."""

    kind: str
    detail: str = ""
    status: int = 0
    code: str = ""


def _body(rng: random.Random, route: str, stream: bool) -> tuple[dict, bool]:
    """A random request for `route`; True when it can never fit (prompt + max_tokens > max_model_len)."""
    unservable = rng.random() < 0.08
    max_tokens = MAX_MODEL_LEN + rng.randint(1, 200) if unservable else rng.randint(1, 128)
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 120)))
    sampling = {"temperature": rng.choice([0.0, 0.7]), "seed": rng.randint(0, 1000), "ignore_eos": rng.random() < 0.5}
    if route == "/v1/chat/completions":
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, **sampling}
    elif route == "/v1/completions":
        prompt = text if rng.random() < 0.5 else [rng.randint(5, 300) for _ in range(rng.randint(1, 200))]
        body = {"prompt": prompt, "max_tokens": max_tokens, **sampling}
    else:
        body = {"input": text, "max_output_tokens": max_tokens, "temperature": sampling["temperature"]}
    return {"model": "tiny", "stream": stream, **body}, unservable


def _check_error(response: httpx.Response) -> Outcome:
    try:
        error = json.loads(response.read())["error"]
    except (ValueError, KeyError, TypeError):
        return Outcome("bad", f"status {response.status_code} without an OpenAI error body", response.status_code)
    key = (response.status_code, error.get("code"))
    if key not in DOCUMENTED_ERRORS:
        return Outcome("bad", f"undocumented error {key}: {error.get('message')}", *key)
    if ("retry-after" in response.headers) != DOCUMENTED_ERRORS[key]:
        return Outcome("bad", f"{key} with Retry-After={response.headers.get('retry-after')}", *key)
    return Outcome("error", error.get("message", ""), *key)


def _read_stream(response: httpx.Response, route: str, cancel_after: int | None) -> Outcome:
    """Read SSE lines until the stream's end (or `cancel_after` data events, then drop the connection)."""
    events, finished = 0, False
    for n, line in enumerate(response.iter_lines()):
        if n > 20_000:
            return Outcome("bad", "stream never ended")
        if not line.startswith("data: "):
            continue
        events += 1
        if line == "data: [DONE]":
            return Outcome("ok") if finished else Outcome("bad", "[DONE] before a finish_reason")
        data = json.loads(line[6:])
        if "error" in data:
            return Outcome("bad", f"error event mid-stream: {data['error']}")
        if route == "/v1/responses":
            if data.get("type") in ("response.completed", "response.incomplete"):  # incomplete: cut at its limit
                return Outcome("ok")
        elif any(c.get("finish_reason") for c in data.get("choices", ())):
            finished = True
        if cancel_after is not None and events >= cancel_after:
            return Outcome("cancelled")  # closing the response drops the connection mid-stream
    return Outcome("bad", "the stream closed without its end")


def _one(client: httpx.Client, url: str, seed: int) -> Outcome:
    rng = random.Random(seed)
    route = rng.choice(ROUTES)
    stream = rng.random() < 0.7
    body, unservable = _body(rng, route, stream)
    cancel = rng.random() < 0.2
    if cancel and not stream:  # disconnect before the answer: a read timeout far shorter than the generation
        try:
            response = client.post(url + route, json=body, timeout=httpx.Timeout(10.0, read=rng.uniform(0.01, 0.2)))
        except httpx.ReadTimeout:
            return Outcome("cancelled")
        return _check_error(response) if response.status_code != 200 else Outcome("ok")
    with client.stream("POST", url + route, json=body) as response:
        if response.status_code != 200:
            outcome = _check_error(response)
        elif stream:
            outcome = _read_stream(response, route, rng.randint(1, 6) if cancel else None)
        else:
            data = json.loads(response.read())
            done = (
                data.get("status") == "completed" or data.get("status") == "incomplete"
                if route == ROUTES[2]
                else all(c.get("finish_reason") in ("stop", "length") for c in data["choices"])
            )
            outcome = Outcome("ok") if done else Outcome("bad", f"incomplete response {data}")
    if unservable and outcome.code != "context_length_exceeded":
        return Outcome("bad", f"an unservable request ended {outcome}")
    return outcome


def _warm_up(client: httpx.Client, url: str) -> None:
    """Every route streamed and not, and one dropped stream: code paths, pools and caches before RSS is measured.

    A few model steps only (< 30), so the injected faults land in the soak itself.
    """
    for route in ROUTES:
        for stream in (False, True):
            body, _ = _body(random.Random(7), route, stream)
            body.update(max_output_tokens=2) if route == "/v1/responses" else body.update(max_tokens=2)
            with client.stream("POST", url + route, json=body) as response:
                assert response.status_code == 200, response.read()
                response.read()
    with client.stream("POST", url + ROUTES[1], json={"prompt": "warm", "max_tokens": 40, "stream": True}) as response:
        next(response.iter_lines())


@pytest.mark.timeout(SOAK_DEADLINE_SECS + 120)
def test_soak(tiny_model_dir: Path) -> None:
    config = dict(
        num_blocks=256,
        max_num_seqs=8,
        max_queue_depth=16,
        max_num_batched_tokens=512,
        max_model_len=MAX_MODEL_LEN,
        max_wait_secs=30.0,
        fault_backoff_secs=0.05,
    )
    settings = ServerSettings(header_timeout_secs=2.0)
    with serving(tiny_model_dir, FAULT_STEPS, settings=settings, **config) as server:
        engine, url = server.engine, server.url
        limits = httpx.Limits(max_connections=NUM_CLIENTS * 2, max_keepalive_connections=NUM_CLIENTS)
        timeout = httpx.Timeout(10.0, read=REQUEST_DEADLINE_SECS)
        with httpx.Client(limits=limits, timeout=timeout) as client:
            _warm_up(client, url)
            assert engine.counters.device_faults == 0, "a fault hit the warm-up: move FAULT_STEPS later"
            # Beside the load: another process holds ~300 slow connections (each trickles a request head
            # and is dropped by the server's head deadline, then replaced) and keeps posting 7.9 MiB bodies.
            # It starts before RSS is first read: the allocator's high-water mark for a few 8 MiB bodies in
            # flight is not a leak.
            hostile = subprocess.Popen([sys.executable, "-c", _HOSTILE, url], stdout=subprocess.PIPE, text=True)
            time.sleep(3.0)
            gc.collect()
            rss_before = rss_bytes()

            seeds = iter(range(NUM_REQUESTS))
            lock = threading.Lock()
            outcomes: list[Outcome] = []

            def worker() -> None:
                while True:
                    with lock:
                        seed = next(seeds, None)
                    if seed is None:
                        return
                    try:
                        outcome = _one(client, url, 1000 + seed)
                    except Exception as exc:  # a timeout past the deadline, a reset, a parse error: all failures
                        outcome = Outcome("bad", f"request seed {1000 + seed}: {type(exc).__name__}: {exc}")
                    with lock:
                        outcomes.append(outcome)
                    # A client that was told to retry later backs off a little (the real Retry-After, >= 1 s,
                    # would mostly idle the run); the others think briefly before their next request.
                    time.sleep(random.uniform(0.3, 1.0) if outcome.status in (429, 503) else random.uniform(0, 0.05))

            # A prober reads /health every 50 ms throughout.
            probes: list[float] = []
            stop = threading.Event()

            def prober() -> None:
                while not stop.is_set():
                    t0 = time.monotonic()
                    status = httpx.get(f"{url}/health", timeout=10).status_code  # 503 while it reloads
                    probes.append(time.monotonic() - t0 if status in (200, 503) else float("inf"))
                    stop.wait(0.05)

            probe = threading.Thread(target=prober, daemon=True)
            probe.start()
            started = time.monotonic()
            threads = [threading.Thread(target=worker, daemon=True) for _ in range(NUM_CLIENTS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=max(0.0, SOAK_DEADLINE_SECS - (time.monotonic() - started)))
            elapsed = time.monotonic() - started
            stop.set()
            probe.join(timeout=10)
            hostile.terminate()
            hostile_report = hostile.communicate(timeout=30)[0]
            assert not any(t.is_alive() for t in threads), f"clients still running after {elapsed:.0f} s"

        kinds = Counter(o.kind for o in outcomes)
        codes = Counter(f"{o.status} {o.code}" for o in outcomes if o.kind == "error")
        print(
            f"\nsoak: {len(outcomes)} requests in {elapsed:.1f} s, {engine.counters.steps} steps; {dict(kinds)}; "
            f"errors {dict(codes)}"
        )
        probes.sort()
        p99 = probes[int(0.99 * (len(probes) - 1))]
        print(f"soak: /health p50 {probes[len(probes) // 2] * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms; {hostile_report}")
        # Measured on two cores with the engine, 32 clients and the prober in one interpreter: p99 0.11-0.32 s.
        # The bound leaves room for a busier CI machine and still catches any stall of seconds (a tokenisation
        # holding the GIL, a blocked event loop, a flood holding every connection).
        assert p99 < 1.0 and probes[-1] < 3.0, (p99, probes[-1])
        assert "oversized 400" in hostile_report and "slow dropped" in hostile_report, hostile_report
        bad = [o for o in outcomes if o.kind == "bad"]
        assert not bad, f"{len(bad)} requests ended badly, e.g. {bad[:5]}"
        assert len(outcomes) == NUM_REQUESTS
        assert kinds["ok"] >= NUM_REQUESTS // 5 and kinds["cancelled"] >= NUM_REQUESTS // 20
        assert codes["400 context_length_exceeded"] >= 1 and codes["429 queue_full"] >= 1

        # Both injected faults hit, each recovered by one reload, invisible to the clients (no 500 above).
        assert engine.counters.device_faults == 2 and engine.counters.model_reloads == 2
        assert engine.health.state == "loaded" and engine.pool.num_blocks == engine.first_num_blocks == 256

        # Nothing leaked: every reservation and block returned, every invariant holds.
        assert wait_for(lambda: engine.snapshot()["in_flight"] == 0 and engine.snapshot()["queue_depth"] == 0, 10)
        snap = engine.snapshot()
        assert snap["blocks_reserved"] == 0 and snap["blocks_in_use"] == 0 and snap["blocks_total"] == 256, snap
        assert engine.pool.num_free_blocks + snap["blocks_cached"] == 256
        engine.check_integrity()
        text = httpx.get(f"{url}/metrics", timeout=10).text
        assert metric(text, "helexa_kv_blocks_reserved") == 0 and metric(text, "helexa_device_faults_total") == 2

        gc.collect()
        growth = rss_bytes() - rss_before
        print(f"soak: RSS grew {growth / (1 << 20):.1f} MiB (bound {RSS_BOUND_BYTES >> 20} MiB)")
        assert growth < RSS_BOUND_BYTES, f"RSS grew {growth / (1 << 20):.1f} MiB over {NUM_REQUESTS} requests"


# The hostile client, in a process of its own: ~300 connections that never finish their request head
# (replaced as the server drops them) and a 7.9 MiB chat body posted over and over. Runs until terminated;
# then prints what it saw.
_HOSTILE = """
import signal, socket, sys, threading, time, httpx
url = sys.argv[1]
host, port = url.removeprefix("http://").split(":")
seen = {"slow dropped": 0, "oversized 400": 0, "oversized other": 0}
running = True
def report(*_):
    print(" ".join(f"{k} {v}" for k, v in seen.items()), flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, report)
def oversized():
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 8283000}]}
    with httpx.Client(timeout=60) as client:
        while True:
            status = client.post(url + "/v1/chat/completions", json=body).status_code
            seen["oversized 400" if status == 400 else "oversized other"] += 1
            time.sleep(0.2)
threading.Thread(target=oversized, daemon=True).start()
slow = []
while True:
    while len(slow) < 300:
        s = socket.create_connection((host, int(port)), timeout=10)
        s.setblocking(False)
        s.sendall(b"POST /v1/completions HTTP/1.1\\r\\nHost: x\\r\\n")
        slow.append(s)
    for s in list(slow):
        try:
            if s.recv(1) == b"":
                seen["slow dropped"] += 1
                s.close()
                slow.remove(s)
        except BlockingIOError:
            pass
    time.sleep(0.1)
"""
