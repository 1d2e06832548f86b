"""The engine core in its own process against the engine in the server's, same run, alternating, default model.

Three servers of the default model run side by side (`python -m helexa.server`, the load generator in this
process): A with the engine on a thread of the server (`HELEXA_ENGINE_PROCESS=0`), B with the core in its
own process (the server's default), C the same with `HELEXA_CORE_NICE=10` (the core 10 steps nicer than the
server, so the server's event loop wins the shared CPU). For each load (1, 16 and 64 streaming clients, and
16 beside the soak's hostile client) they are measured in turn, `--rounds` times each, the order
alternating: `/health` latency p50/p99 (probed every 20 ms from a process of its own during the load),
every stream's inter-token gaps p50/p99, and the aggregate output tokens/s. Then, on B only: the time from
a SIGKILL of the core to the next new token of a stream (the replay), and the channel's own cost per token
event (encode, frame, socket, decode) measured alone. Last, each mode's resident memory after the loads
(server, and core where there is one).

    python bench/core_process.py                # 3 rounds, 32 tokens a stream
    python bench/core_process.py --quick        # 1 round, 8 tokens, loads 1 and 16

Prints the CPU, a table with the ratios to A, writes bench/out/core_process.md and core_process.png.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.server_process import ServerProcess  # noqa: E402
from bench.test_bench_step import cpu_name  # noqa: E402
from helexa.engine.core.wire import event_from_plain, event_to_plain, read_frame, write_frame  # noqa: E402
from helexa.engine.stream import TokenEvent, TokenLogprob  # noqa: E402
from tests.reliability.test_soak import _HOSTILE  # noqa: E402  (the soak's hostile client, as it is)

OUT = Path(__file__).resolve().parent / "out"
# each mode's environment: A the engine on a thread of the server, B the core in its own process, C that core
# running 10 steps nicer than the server (HELEXA_CORE_NICE), so the event loop wins the shared CPU
MODES = {
    "A in-process": {"HELEXA_ENGINE_PROCESS": "0"},
    "B core process": {"HELEXA_ENGINE_PROCESS": "1", "HELEXA_CORE_NICE": "0"},
    "C core, nice 10": {"HELEXA_ENGINE_PROCESS": "1", "HELEXA_CORE_NICE": "10"},
}
# `/health` is probed from a process of its own (a kept-alive connection, one GET every 20 ms), so what it
# measures is the server, not the load generator's own event loop
_PROBE = """
import http.client, sys, time
host, port = sys.argv[1], int(sys.argv[2])
conn, out = http.client.HTTPConnection(host, port, timeout=30), []
while not sys.stdin.closed:
    t0 = time.perf_counter()
    conn.request("GET", "/health")
    conn.getresponse().read()
    out.append(time.perf_counter() - t0)
    time.sleep(0.02)
    if len(out) % 10 == 0:
        import select
        if select.select([sys.stdin], [], [], 0)[0]:
            break
print(" ".join(f"{x:.6f}" for x in out))
"""
PROMPT = "Write a short plan with three steps about caching memory blocks for an agent session number {i}."


def _server(mode_env: dict[str, str], max_num_seqs: int) -> ServerProcess:
    """A server in one of `MODES`, sized for the loads here."""
    env = {**mode_env, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    argv = ["--kv-cache-memory", "1GiB", "--max-num-seqs", str(max_num_seqs),
            "--max-queue-depth", "512", "--max-connections", "2048"]  # fmt: skip
    return ServerProcess(argv, env)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def _stream(client: httpx.AsyncClient, url: str, i: int, max_tokens: int, arrivals: list[float]) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": PROMPT.format(i=i)}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"content":"' in line:
                arrivals.append(time.perf_counter())


async def _load(url: str, streams: int, max_tokens: int) -> dict[str, float]:
    arrivals: list[list[float]] = [[] for _ in range(streams)]
    host, port = url.removeprefix("http://").split(":")
    prober = subprocess.Popen([sys.executable, "-c", _PROBE, host, port], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(_stream(client, url, i, max_tokens, arrivals[i]) for i in range(streams)))
        wall = time.perf_counter() - t0
    out, _ = prober.communicate("stop\n", timeout=60)
    health = [float(x) for x in out.split()]
    gaps = [b - a for times in arrivals for a, b in zip(times, times[1:])]
    tokens = sum(len(t) for t in arrivals)
    return {"health_p50": pct(health, 0.5), "health_p99": pct(health, 0.99), "itl_p50": pct(gaps, 0.5),
            "itl_p99": pct(gaps, 0.99), "tok_s": tokens / wall}  # fmt: skip


def measure(server: ServerProcess, streams: int, max_tokens: int, hostile: bool) -> dict[str, float]:
    attacker = None
    if hostile:
        attacker = subprocess.Popen([sys.executable, "-c", _HOSTILE, server.url], stdout=subprocess.PIPE, text=True)
        time.sleep(2.0)  # its connections are open before the load starts
    try:
        return asyncio.run(_load(server.url, streams, max_tokens))
    finally:
        if attacker is not None:
            attacker.terminate()
            attacker.communicate(timeout=30)


async def _kill_to_token(server: ServerProcess, max_tokens: int) -> float:
    """Seconds from a SIGKILL of B's core to the next new token of the stream it interrupted."""
    arrivals: list[float] = []
    async with httpx.AsyncClient(timeout=600) as client:
        task = asyncio.ensure_future(_stream(client, server.url, 0, max_tokens, arrivals))
        while len(arrivals) < max_tokens // 2:
            await asyncio.sleep(0.005)
        seen = len(arrivals)
        killed = time.perf_counter()
        os.kill(server.core_pid(), signal.SIGKILL)
        while len(arrivals) == seen and not task.done():
            await asyncio.sleep(0.002)
        first = arrivals[seen] if len(arrivals) > seen else float("nan")
        await task
    return first - killed


def channel_cost(n: int = 20000) -> tuple[float, float]:
    """Microseconds per token event through the channel: one event a frame, and 16 events a frame (an event
    with logprobs: it crosses in full, not compact)."""
    event = TokenEvent(token_ids=(1234,), text=" word", logprobs=(TokenLogprob(1234, -0.5),), num_prompt_tokens=60)
    a, b = socket.socketpair()
    results = []
    for per_frame in (1, 16):
        frames = n // per_frame

        def reader(frames: int = frames) -> None:
            for _ in range(frames):
                for _rid, plain, _g in read_frame(b)[1]:
                    event_from_plain(plain)

        thread = threading.Thread(target=reader)
        t0 = time.perf_counter()
        thread.start()
        for _ in range(frames):
            write_frame(a, ("events", [("cmpl-0123456789abcdef-0", event_to_plain(event), None)] * per_frame))
        thread.join()
        results.append((time.perf_counter() - t0) / n * 1e6)
    a.close()
    b.close()
    return results[0], results[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    loads = [(1, False), (16, False), (64, False), (16, True)]
    if args.quick:
        args.rounds, args.max_tokens, loads = 1, 8, [(1, False), (16, False)]
    print(f"CPU: {cpu_name()} ({os.cpu_count()} cores visible, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')})")
    servers = {name: _server(env, max_num_seqs=64) for name, env in MODES.items()}
    for name, server in servers.items():
        load_line = server.find(r"model: loaded .*")
        print(f"{name}: {server.url} | {load_line.group(0)[:200] if load_line else '?'}")
    rows: dict[tuple[str, str], list[dict[str, float]]] = {}
    try:
        for server in servers.values():  # warm both: first requests compile and fill caches
            measure(server, 4, 4, False)
        for streams, hostile in loads:
            label = f"{streams} streams" + (" + hostile" if hostile else "")
            for r in range(args.rounds):
                order = list(servers) if r % 2 == 0 else list(reversed(servers))  # alternating order
                for name in order:
                    result = measure(servers[name], streams, args.max_tokens, hostile)
                    rows.setdefault((label, name), []).append(result)
                    print(f"{label:22} {name:15} round {r}: " + " ".join(f"{k}={v:.4g}" for k, v in result.items()))
        rss = {name: server.rss_mib() for name, server in servers.items()}
        kills = [asyncio.run(_kill_to_token(servers["B core process"], max(16, args.max_tokens)))
                 for _ in range(1 if args.quick else 2)]  # fmt: skip
    finally:
        for server in servers.values():
            server.stop()
    one, batched = channel_cost()
    table = _table(rows)
    text = "\n".join([
        f"CPU: {cpu_name()}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; {args.rounds} rounds, "
        f"{args.max_tokens} tokens a stream, medians of the rounds", "", *table, "",
        f"core SIGKILL -> next new token of the interrupted stream: {', '.join(f'{k:.2f} s' for k in kills)}",
        f"channel cost per token event: {one:.1f} us (one a frame), {batched:.1f} us (16 a frame)",
        "resident memory after the loads, MiB (server + core): " + "; ".join(f"{k}: {v}" for k, v in rss.items()),
    ])  # fmt: skip
    print(text)
    OUT.mkdir(exist_ok=True)
    (OUT / "core_process.md").write_text(text + "\n")
    _plot(rows, OUT / "core_process.png")
    return 0


def _median(rows: list[dict[str, float]], key: str) -> float:
    return pct([r[key] for r in rows], 0.5)


def _table(rows: dict[tuple[str, str], list[dict[str, float]]]) -> list[str]:
    lines = ["| load | mode | /health p50 ms | /health p99 ms | ITL p50 ms | ITL p99 ms | tok/s | tok/s / A |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    labels = list(dict.fromkeys(label for label, _ in rows))
    for label in labels:
        base = _median(rows[(label, "A in-process")], "tok_s")
        for name in MODES:
            ms = [f"{_median(rows[(label, name)], key) * 1e3:.1f}" for key in ("health_p50", "health_p99", "itl_p50",
                                                                             "itl_p99")]  # fmt: skip
            tok_s = _median(rows[(label, name)], "tok_s")
            lines.append(f"| {label} | {name} | {' | '.join(ms)} | {tok_s:.1f} | {tok_s / base:.2f} |")
    return lines


def _plot(rows: dict[tuple[str, str], list[dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(label for label, _ in rows))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    panels = (("health_p99", "/health p99 (ms)"), ("itl_p99", "ITL p99 (ms)"), ("tok_s", "tok/s"))
    for ax, (key, title) in zip(axes, panels):
        for k, name in enumerate(MODES):
            values = [_median(rows[(label, name)], key) * (1 if key == "tok_s" else 1e3) for label in labels]
            ax.bar([x + 0.27 * k for x in range(len(labels))], values, width=0.27, label=name)
        ax.set_xticks([x + 0.27 for x in range(len(labels))], labels, fontsize=7)
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"engine core in its own process vs in the server's ({cpu_name()})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
