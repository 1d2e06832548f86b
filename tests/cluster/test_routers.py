"""Real routers on loopback: three helexa replicas of the tiny model (subprocesses) behind `vllm-router` and
`sglang-router` (the pinned PyPI releases; installed here when missing, else the tests skip saying why).

- Agent sessions (a per-session system prompt, 4 turns) under `kv_aware` (fed by helexa's KV events),
  `cache_aware` and `consistent_hash`: the prompt tokens turns 2-4 find cached are >= 90% of what one
  replica holding every session finds (the best possible), and the sessions spread over >= 2 replicas.
- `power_of_two` reads `/get_load`: a replica whose KV blocks are all reserved, with a request queued,
  gets no new request while the others have room (its slots held by streams on the interpreted Triton kernels).
- A replica SIGKILLed mid-run costs no request; restarted on the same ports it serves again and its KV
  events (the fixed loopback port) are credited by `kv_aware` again.
- `sglang-router`'s `cache_aware` policy: the same sessions.

The replicas otherwise run the CPU attention a CPU node runs (`--attention-backend torch`), not the Triton
interpreter the rest of the suite runs the kernels in (that made each answer ~30 times as slow: the file took
~7 minutes on two cores).

Every process is started in its own session and killed (SIGTERM, then SIGKILL) when its test ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.support.models import corpus
from tests.support.servers import make_tiny_model_dir

pytestmark = pytest.mark.alone  # measures time: a replica must stay full for seconds while another answers

# The router releases these tests run (also pinned in pyproject.toml's `test` extra).
VLLM_ROUTER = ("vllm-router", "0.1.17")
SGLANG_ROUTER = ("sglang-router", "0.3.2")
SESSIONS, TURNS, ANSWER_TOKENS = 4, 4, 4
BLOCK_SIZE, NUM_BLOCKS = 16, 1024  # every session fits one replica's cache: the best possible is all hits
POLL_EVERY_2_SECS = ("--worker-startup-check-interval", "2")  # vllm-router's /get_load poll interval too


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _installed(package: str, version: str, module: str) -> None:
    """Import `module` (the router's Python package), installing `package==version` from PyPI when missing;
    skip with the reason when it cannot be had."""
    try:
        __import__(module)
        return
    except ImportError:
        pass
    try:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", f"{package}=={version}"],
            check=True, capture_output=True, timeout=300,
        )  # fmt: skip
        __import__(module)
    except (subprocess.SubprocessError, ImportError, OSError) as exc:
        pytest.skip(f"{package}=={version} is not installed and could not be installed from PyPI: {exc}")


def _stop(proc: subprocess.Popen[bytes], grace: float = 8.0) -> None:
    """SIGTERM the process's session, then SIGKILL it after `grace` seconds."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{url}: the process exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise AssertionError(f"{url} did not answer 200 within {timeout} s")


@dataclass
class Replica:
    """One `python -m helexa.server` on fixed loopback ports (HTTP, KV events, replay), restartable.

    `attention_backend`: "torch" (the CPU kernels a CPU node runs: a 4-token answer in ~0.1 s) or "triton" (the
    Triton kernels in the suite's interpreter, ~30 times as slow: a replica whose streams hold its slots for
    minutes)."""

    model_dir: Path
    log: Path
    attention_backend: str = "torch"
    port: int = field(default_factory=_free_port)
    events_port: int = field(default_factory=_free_port)
    replay_port: int = field(default_factory=_free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def start(self) -> None:
        argv = [
            sys.executable, "-m", "helexa.server", "--model", str(self.model_dir), "--device", "cpu",
            "--host", "127.0.0.1", "--port", str(self.port), "--attention-backend", self.attention_backend,
            "--block-size", str(BLOCK_SIZE), "--num-blocks", str(NUM_BLOCKS), "--max-num-seqs", "2",
            "--max-model-len", "2048",
            "--max-wait-secs", "36000",  # the full replica's queued request waits (on CPU its estimate is long)
            "--kv-events-endpoint", self.events, "--kv-events-replay-endpoint", self.replay,
            "--kv-events-encoding", "map", "--log-level", "info",  # info: the access log shows the load polls
        ]  # fmt: skip
        env = {**os.environ, "TRITON_INTERPRET": "1" if self.attention_backend == "triton" else "0"}  # Triton on CPU
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def wait_ready(self, timeout: float = 120) -> None:
        _wait_http(self.url + "/health", timeout, self.proc)

    def kill(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)

    def load_polls(self) -> int:
        """`GET /get_load` requests this replica has answered (its access log)."""
        return self.log.read_text(errors="replace").count('"GET /get_load HTTP/1.1" 200')

    def admission(self) -> dict:
        return httpx.get(self.url + "/v1/admission", timeout=60).json()  # a busy CPU replica answers slowly


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    """Three replicas of the tiny chat model, started together (about 10-20 s on two cores)."""
    root = tmp_path_factory.mktemp("routers")
    with started([Replica(make_tiny_model_dir(root / "model"), root / f"replica{i}.log") for i in range(3)]) as reps:
        yield reps


@contextlib.contextmanager
def started(reps: list[Replica]) -> Iterator[list[Replica]]:
    """`reps` started together, ready; stopped on exit."""
    try:
        for rep in reps:
            rep.start()
        for rep in reps:
            rep.wait_ready()
        yield reps
    finally:
        for rep in reps:
            rep.stop()


@contextlib.contextmanager
def running_router(argv: list[str], log: Path) -> Iterator[str]:
    """A router process on a free loopback port; yields its URL once it answers `/health`."""
    port = _free_port()
    full = [*argv, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(_free_port())]
    with log.open("ab") as out:
        proc = subprocess.Popen(full, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", 60, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(proc)


def vllm_router(reps: list[Replica], policy: str, *extra: str) -> list[str]:
    _installed(*VLLM_ROUTER, "vllm_router")
    return [
        sys.executable, "-m", "vllm_router.launch_router", "--worker-urls", *(r.url for r in reps),
        "--policy", policy, "--health-check-interval-secs", "1", "--cb-timeout-duration-secs", "1",
        "--log-level", "info", *extra,
    ]  # fmt: skip


def kv_sources(reps: list[Replica], model: str) -> list[str]:
    """vllm-router's flags for kv_aware over the replicas' KV event streams (fixed loopback ports)."""
    args = ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", model]
    for r in reps:
        args += ["--kv-event-source", f"{r.url}={r.events}", "--kv-event-replay-source", f"{r.url}={r.replay}"]
    return args


def _flush(reps: list[Replica]) -> None:
    for r in reps:
        assert httpx.post(r.url + "/flush_cache", timeout=30).status_code == 200
        assert r.admission()["blocks_cached"] == 0


def _model(reps: list[Replica]) -> str:
    return httpx.get(reps[0].url + "/v1/models", timeout=10).json()["data"][0]["id"]


@dataclass
class SessionRun:
    cached: dict[tuple[int, int], int]  # (session, turn) -> prompt tokens found cached
    served_by: dict[tuple[int, int], list[int]]  # (session, turn) -> the replicas whose admissions rose

    def later_hits(self) -> int:
        return sum(v for (_, t), v in self.cached.items() if t > 0)

    def session_replicas(self) -> set[int]:
        """The replicas that served the sessions' second turns (where each session's cache is)."""
        return {rep for (_, t), reps in self.served_by.items() if t == 1 for rep in reps}


def run_sessions(url: str, reps: list[Replica], model: str, session_header: bool = False) -> SessionRun:
    """SESSIONS agent sessions of TURNS turns: every session's first turn at once (agents start together),
    then one turn of every session after another, each request alone, so which replica served it is read
    from the replicas' admission counters."""
    texts = corpus(SESSIONS * 8, seed=7)
    histories = [
        [{"role": "system", "content": f"session {s}: " + " ".join(texts[s * 8 : s * 8 + 5])}] for s in range(SESSIONS)
    ]
    run = SessionRun({}, {})

    def turn_of(s: int, turn: int, http: httpx.Client) -> dict:
        history = histories[s]
        history.append({"role": "user", "content": texts[s * 8 + 5 + turn % 3] + f" (turn {turn})"})
        headers = {"X-Session-ID": f"agent-{s}"} if session_header else {}
        body = {"model": model, "messages": history, "max_tokens": ANSWER_TOKENS, "temperature": 0}
        reply = http.post(url + "/v1/chat/completions", json=body, headers=headers)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        run.cached[(s, turn)] = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        history.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
        return answer

    with httpx.Client(timeout=120) as http:
        firsts = [threading.Thread(target=turn_of, args=(s, 0, http)) for s in range(SESSIONS)]
        for t in firsts:
            t.start()
        for t in firsts:
            t.join(120)
        assert len(run.cached) == SESSIONS, "a first turn failed"
        for turn in range(1, TURNS):
            for s in range(SESSIONS):
                before = [r.admission()["admitted_total"] for r in reps]
                turn_of(s, turn, http)
                after = [r.admission()["admitted_total"] for r in reps]
                run.served_by[(s, turn)] = [i for i in range(len(reps)) if after[i] > before[i]]
    return run


@pytest.fixture(scope="module")
def best(replicas: list[Replica]) -> SessionRun:
    """The best possible: every session on one replica (the sessions all fit its cache)."""
    _flush(replicas)
    return run_sessions(replicas[0].url, replicas, _model(replicas))


def _check_sessions(run: SessionRun, best: SessionRun, name: str, more: set[int] | None = None) -> float:
    """Turns 2-4 find >= 90% of the best possible hits, and the sessions (with `more`: the replicas that served
    further sessions) spread over >= 2 replicas."""
    assert best.later_hits() > 0
    rate = run.later_hits() / best.later_hits()
    spread = run.session_replicas() | (more or set())
    print(f"{name}: hit tokens of turns 2-4 {run.later_hits()} of a possible {best.later_hits()} ({rate:.3f}); "
          f"sessions on replicas {sorted(run.session_replicas())}, with further sessions {sorted(spread)}")  # fmt: skip
    assert rate >= 0.9, f"{name}: {rate:.3f} of the best possible prefix hits"
    assert len(spread) >= 2, f"{name}: every session went to one replica"
    return rate


def _replicas_of_sessions(url: str, reps: list[Replica], model: str, sessions: list[str]) -> set[int]:
    """The replicas that serve one short request of each session id (`X-Session-ID`), sent one at a time.

    Under `consistent_hash` where a session goes is its id's place on a ring of the replicas' URLs (random
    ports): the 4 sessions of `run_sessions` all land on one of 3 replicas 1 time in 27, so the spread is
    asked of more ids (20 on one replica: about 1 in 10^9), not of those 4."""
    served: set[int] = set()
    with httpx.Client(timeout=60) as http:
        for session in sessions:
            before = [r.admission()["admitted_total"] for r in reps]
            body = {"model": model, "prompt": f"hello from {session}", "max_tokens": 1}
            reply = http.post(url + "/v1/completions", json=body, headers={"X-Session-ID": session})
            assert reply.status_code == 200, reply.text
            after = [r.admission()["admitted_total"] for r in reps]
            served.update(i for i in range(len(reps)) if after[i] > before[i])
    return served


@pytest.mark.parametrize("policy", ["kv_aware", "cache_aware", "consistent_hash"])
def test_vllm_router_keeps_sessions_on_their_cache(
    replicas: list[Replica], best: SessionRun, policy: str, tmp_path: Path
) -> None:
    model = _model(replicas)
    extra = {"kv_aware": kv_sources(replicas, model), "cache_aware": [], "consistent_hash": []}[policy]
    _flush(replicas)
    with running_router(vllm_router(replicas, policy, *extra), tmp_path / "router.log") as url:
        run = run_sessions(url, replicas, model, session_header=policy == "consistent_hash")
        more = None
        if policy == "consistent_hash":
            more = _replicas_of_sessions(url, replicas, model, [f"probe-{i}" for i in range(16)])
        if policy == "kv_aware":  # the router fans its /flush_cache out to every replica (behind their key)
            assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200
            assert all(r.admission()["blocks_cached"] == 0 for r in replicas)
    _check_sessions(run, best, f"vllm-router {policy}", more)


def test_sglang_router_cache_aware_keeps_sessions_on_their_cache(
    replicas: list[Replica], best: SessionRun, tmp_path: Path
) -> None:
    _installed(*SGLANG_ROUTER, "sglang_router")
    argv = [
        sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *(r.url for r in replicas),
        "--policy", "cache_aware", "--log-level", "info",
    ]  # fmt: skip
    _flush(replicas)
    with running_router(argv, tmp_path / "router.log") as url:
        run = run_sessions(url, replicas, _model(replicas))
    _check_sessions(run, best, "sglang-router cache_aware")


def test_power_of_two_routes_around_a_full_replica(replicas: list[Replica], tmp_path: Path) -> None:
    """A replica's two sequence slots are taken by long streams and a third waits; after the router's next
    load polls, requests through `power_of_two` never reach it while the others have room.

    The full replica is one of its own, on the interpreted Triton kernels: its 2,000-token streams hold its slots
    for minutes, past the router's polls, where a CPU replica would finish them in seconds."""
    full = Replica(replicas[0].model_dir, tmp_path / "full.log", attention_backend="triton")
    with started([full]):
        _route_around(full, [full, *replicas[1:]], tmp_path)


def _route_around(full: Replica, replicas: list[Replica], tmp_path: Path) -> None:
    model = _model(replicas)
    long = {"model": model, "prompt": "one two three", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    stop = threading.Event()

    def hold() -> None:  # a stream kept open until the test ends (closing it aborts the request)
        with contextlib.suppress(httpx.HTTPError):
            with httpx.stream("POST", full.url + "/v1/completions", json=long, timeout=120) as r:
                for _ in r.iter_bytes():
                    if stop.is_set():
                        return

    holders = [threading.Thread(target=hold, daemon=True) for _ in range(3)]
    # vllm-router polls /get_load every --worker-startup-check-interval seconds (30 by default in 0.1.17)
    with running_router(vllm_router(replicas, "power_of_two", *POLL_EVERY_2_SECS), tmp_path / "router.log") as url:
        try:
            for t in holders:
                t.start()
            assert _poll(lambda: full.admission()["queue_depth"] == 1, 90)
            load = httpx.get(full.url + "/get_load", timeout=10).json()
            others = [httpx.get(r.url + "/get_load", timeout=10).json() for r in replicas[1:]]
            assert load["admissible_tokens"] == 0 and load["num_waiting_reqs"] == 1
            assert all(o["admissible_tokens"] > 0 and o["load"] < load["load"] for o in others)
            polls = full.load_polls()  # the router polls /get_load on its own (every 2 s here): wait for two polls
            assert _poll(lambda: full.load_polls() >= polls + 2, 30), "the router never polled the full replica"
            before = {i: r.admission()["admitted_total"] for i, r in enumerate(replicas)}
            short = {"model": model, "prompt": "four five", "max_tokens": 2}
            for _ in range(9):
                assert httpx.post(url + "/v1/completions", json=short, timeout=60).status_code == 200
            after = {i: r.admission()["admitted_total"] for i, r in enumerate(replicas)}
            assert full.admission()["queue_depth"] == 1
            assert after[0] == before[0], "the full replica was given new work"
            assert after[1] + after[2] - before[1] - before[2] == 9
        finally:
            stop.set()
            for t in holders:
                t.join(30)
    assert _poll(lambda: full.admission()["in_flight"] == 0, 30)


def _poll(predicate, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_a_killed_replica_costs_no_request_and_rejoins_with_its_kv_events(
    replicas: list[Replica], tmp_path: Path
) -> None:
    victim = replicas[2]
    model = _model(replicas)
    _flush(replicas)
    extra = kv_sources(replicas, model)
    with running_router(vllm_router(replicas, "kv_aware", *extra), tmp_path / "router.log") as url:
        results: list[int] = []

        def load() -> None:  # bounded: 20 requests, a new prompt each
            with httpx.Client(timeout=60) as http:
                for i in range(20):
                    body = {"model": model, "prompt": f"load {i} " + "alpha beta " * 20, "max_tokens": 4}
                    results.append(http.post(url + "/v1/completions", json=body).status_code)

        worker = threading.Thread(target=load)
        worker.start()
        assert _poll(lambda: len(results) >= 3, 60)
        victim.kill()
        worker.join(120)
        assert results == [200] * 20, results

        victim.start()  # the same HTTP, KV event and replay ports
        victim.wait_ready()
        # Until the router's health check and circuit breaker let the victim back in, a routed request
        # lands elsewhere and caches its prompt there too; so each try caches a new prompt on the victim
        # alone (directly), then routes it: the try that lands on the victim shows it is back and credited.
        deadline = time.monotonic() + 60
        for attempt in range(1000):
            prompt = f"rejoin {attempt} " + " ".join(corpus(4, seed=11 + attempt))
            body = {"model": model, "prompt": prompt, "max_tokens": 2}
            assert httpx.post(victim.url + "/v1/completions", json=body, timeout=60).status_code == 200
            time.sleep(0.5)  # its KV events reach the router
            warm = victim.admission()["admitted_total"]
            reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200
            if victim.admission()["admitted_total"] > warm:
                break
            assert time.monotonic() < deadline, "the restarted replica never got a request"
            time.sleep(1.0)
        assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        for _ in range(3):  # its new KV events are credited: the cached prompt goes to it every time
            got = victim.admission()["admitted_total"]
            reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200 and victim.admission()["admitted_total"] == got + 1
