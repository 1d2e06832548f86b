"""Hostile schemas through the real server (issue 31, part of the fuzz set beside `test_fuzz.py`): an
`anyOf` thousands wide with `n=64`, a deep `$ref` chain, catastrophic patterns, a 50k-item enum,
`minItems` 10^9, and the same as forced tool schemas. While each runs, a stream keeps running and
`/health` is probed every 50 ms: the stream's largest inter-token gap and `/health`'s p99 must stay
within the first hardening round's margins (`tests/server/test_hardening.py`,
`tests/reliability/test_soak.py`). Every answer is a 200 or a documented 400 naming the field, no
block is left reserved or allocated afterwards, and the process's RSS comes back to within
`RSS_MARGIN_BYTES` of what it was before the hostile cases.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.reliability.test_fuzz import _assert_documented, _assert_nothing_leaked
from tests.support.servers import RunningServer, rss_bytes, serving, wait_for

pytestmark = pytest.mark.alone  # measures time: /health's p99 and a running stream's gaps are held to bounds

# The first round's margins, on this noisy 2-core machine: /health p99 < 1.0 s (the soak's) and no probe
# over 1.5 s; a running stream's largest gap under its own baseline + 1.0 s (the largest-bodies test's).
HEALTH_P99_SECS, HEALTH_MAX_SECS, GAP_MARGIN_SECS = 1.0, 1.5, 1.0
# RSS after the cases, over before: the grammar caches' bounds (192 MiB of ready matchers, 32 MiB of grammar
# text) and 64 MiB for everything else. Measured: +{MEASURED} MiB; before the bounds and the heap trim, the same
# cases left ~{BEFORE} MiB resident (the issue saw +1.5 GB over its probes with the default model).
RSS_MARGIN_BYTES = 256 << 20
DISTINCT_SCHEMAS = 24  # each a new anyOf 1,000 wide: a client that never repeats one fills the caches


def _object(i: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}


def _ref_chain(depth: int) -> dict[str, Any]:
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(depth)}
    return {"$defs": {**defs, f"d{depth}": {"type": "string", "maxLength": 3}}, "$ref": "#/$defs/d0"}


# name -> (schema, n); each is sent as a response_format and, with n=1, as a forced tool's parameters.
HOSTILE: dict[str, tuple[Any, int]] = {
    "anyOf 2,000 wide, n=64": ({"anyOf": [_object(i) for i in range(2000)]}, 64),
    "anyOf 5,000 wide": ({"anyOf": [_object(i) for i in range(5000)]}, 1),  # over the size budget: 400
    "deep $ref (a chain of 3,000)": (_ref_chain(3000), 4),  # overflowed a default thread stack: a segfault
    "catastrophic pattern": ({"type": "string", "pattern": "^(a+)+(b|c|d{1,100}){1,100}$"}, 4),
    "nested repetition": ({"type": "string", "pattern": "^((a|aa)*){1,1000}(x{1,1000}){1,1000}$"}, 4),
    "enum of 50,000": ({"enum": [f"v{i}" for i in range(50_000)]}, 4),
    "minItems 10^9": ({"type": "array", "items": {"type": "integer"}, "minItems": 10**9}, 4),
}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    """Room for 64 short choices and a long stream beside them."""
    with serving(tiny_model_dir, num_blocks=512, max_num_seqs=8, max_queue_depth=256) as running:
        yield running


class _Stream:
    """A long stream in a thread; `arrivals` holds the arrival time of each of its events."""

    def __init__(self, url: str) -> None:
        self.arrivals: list[float] = []
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 1500, "stream": True, "ignore_eos": True}

        def read() -> None:
            with contextlib.suppress(httpx.HTTPError):  # (cut short when the test ends)
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            self.arrivals.append(time.monotonic())

        self.thread = threading.Thread(target=read, daemon=True)
        self.thread.start()

    def gaps(self, since: float, until: float) -> list[float]:
        times = list(self.arrivals)
        return [b - a for a, b in zip(times, times[1:]) if since <= b <= until]


def _hostile_body(schema: Any, n: int, as_tool: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "answer in JSON"}],
        "max_tokens": 6,
        "n": n,
        "temperature": 1.0,
        "seed": 1,
    }
    if as_tool:
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        body["tool_choice"] = "required"
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "h", "schema": schema}}
    return body


def test_hostile_schemas_stall_no_one(server: RunningServer) -> None:
    stream = _Stream(server.url)
    assert wait_for(lambda: len(stream.arrivals) > 30, 30)
    baseline = max(stream.gaps(0.0, time.monotonic()))
    gc.collect()
    rss_before = rss_bytes()
    probes: list[float] = []
    windows: list[tuple[str, float]] = []
    outcomes: dict[str, int] = {}
    for (name, (schema, n)), as_tool in [(case, False) for case in HOSTILE.items()] + [
        (case, True) for case in HOSTILE.items()
    ]:
        what = f"{name} ({'tools' if as_tool else 'response_format'})"
        if len(stream.arrivals) > 1200:  # keep a stream running through every case
            stream = _Stream(server.url)
            assert wait_for(lambda s=stream: len(s.arrivals) > 5, 30)
        body = _hostile_body(schema, 1 if as_tool else n, as_tool)
        answer: dict[str, Any] = {}

        def send(body: dict[str, Any] = body, answer: dict[str, Any] = answer) -> None:
            response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
            answer.update(status=response.status_code, body=response.json(), headers=response.headers)

        start = time.monotonic()
        client = threading.Thread(target=send)
        client.start()
        while client.is_alive():
            t0 = time.monotonic()
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
            probes.append(time.monotonic() - t0)
            client.join(0.05)
        end = time.monotonic()
        window = stream.gaps(start, end)
        windows.append((what, max(window, default=0.0)))
        error = answer["body"].get("error") if answer["status"] != 200 else None
        _assert_documented(answer["status"], error, answer["headers"], what)
        if error is not None:  # refused: the field that holds the schema is named
            assert error["param"] in ("response_format", "tools", "tools[0].function.parameters"), error
        else:
            assert len(answer["body"]["choices"]) == (1 if as_tool else n)
        outcomes[what] = answer["status"]
        print(f"hostile schema {what}: {answer['status']} in {end - start:.2f} s, largest gap {windows[-1][1]:.3f} s")
    probes.sort()
    p99 = probes[int(0.99 * (len(probes) - 1))]
    worst_gap = max(windows, key=lambda w: w[1])
    print(f"hostile schemas: /health p99 {p99:.3f} s max {probes[-1]:.3f} s; stream gap baseline {baseline:.3f} s, "
          f"worst {worst_gap[1]:.3f} s ({worst_gap[0]}); {outcomes}")  # fmt: skip
    assert p99 < HEALTH_P99_SECS and probes[-1] < HEALTH_MAX_SECS, (p99, probes[-1])
    assert worst_gap[1] < baseline + GAP_MARGIN_SECS, (worst_gap, baseline)
    assert outcomes["anyOf 2,000 wide, n=64 (response_format)"] == 200  # compiled once, shared by 64 choices
    assert outcomes["anyOf 5,000 wide (response_format)"] == 400  # over the size budget, refused before work
    for i in range(DISTINCT_SCHEMAS):  # a client that never repeats a schema fills the caches to their bounds
        schema = {"anyOf": [_object(j + 1000 * i) for j in range(1000)]}
        body = {**_hostile_body(schema, 1, False), "max_tokens": 1}
        assert httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).status_code == 200
    _assert_nothing_leaked(server)
    gc.collect()
    growth = rss_bytes() - rss_before
    print(f"hostile schemas: RSS grew {growth / (1 << 20):.0f} MiB (margin {RSS_MARGIN_BYTES >> 20} MiB)")
    assert growth < RSS_MARGIN_BYTES, f"RSS grew {growth / (1 << 20):.0f} MiB"
