"""Streaming through the real server when the forward is fast: the aggregate output rate at 1, 16 and 64
concurrent streams, and the CPU each process spends per token.

`python -m helexa.server` serves the test suite's tiny Llama (vocabulary 512; its forward takes ~1-4 ms, as a
GPU's would, so what the engine thread, the core's event loop, the channel and the server's event loop do per
token decides the rate). The engine core runs in its own process (the server's default); the load generator
(this process) opens N streaming completions at once (`/v1/completions`, greedy, `ignore_eos`) and counts the
chunks that arrive. It also reads the CPU time the server's process and the core's spent over each load
(`/proc`), per token: steadier than the rate on a shared machine. With `--baseline REV` another commit's
tree is served in the same run, the trees alternating round by round, a fresh server each round.

    python bench/serve_streams.py                       # this tree, 3 rounds, 256 tokens a stream
    python bench/serve_streams.py --baseline HEAD~2     # and another commit, alternating
    python bench/serve_streams.py --quick               # 1 round, 32 tokens

Writes `bench/out/serve_streams.md` and `bench/out/serve_streams.png`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from server_process import ServerProcess  # noqa: E402
from trees import alternate  # noqa: E402

OUT = ROOT / "bench" / "out"
LOADS = (1, 16, 64)
_START_SECS = 120.0


def _start(tree: Path, model: Path) -> ServerProcess:
    """`python -m helexa.server` serving `model` from `tree`, sized for the largest load; refused (`SystemExit`)
    when its engine runs on a thread of the server (`HELEXA_ENGINE_PROCESS=0`): not what is measured."""
    argv = ["--model", str(model), "--max-num-seqs", str(max(LOADS)), "--num-blocks", "4096", "--block-size", "16"]
    try:
        server = ServerProcess(argv, tree=tree, start_secs=_START_SECS)
    except RuntimeError as exc:
        raise SystemExit(f"the server in {tree} did not start: {exc}") from None
    if not server.has_core():
        server.stop()
        raise SystemExit(f"the server in {tree} runs its engine on a thread, not in a core process of its own")
    return server


async def _stream(client: httpx.AsyncClient, url: str, i: int, tokens: int) -> int:
    body = {"model": "tiny", "prompt": f"request {i}: " + "hello there " * 4, "max_tokens": tokens,
            "stream": True, "ignore_eos": True, "temperature": 0}  # fmt: skip
    chunks = 0
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += 1
    return chunks


_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    """The user and system CPU time process `pid` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


async def _load(url: str, streams: int, tokens: int, pids: tuple[int, int]) -> dict[str, float]:
    """Over `streams` concurrent streams of `tokens` tokens each (after one warm-up stream): tokens a second,
    and the server's and the core's CPU microseconds a token."""
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=streams + 4)) as client:
        await _stream(client, url, -1, 8)
        cpu = [_cpu_seconds(pid) for pid in pids]
        start = time.perf_counter()
        counts = await asyncio.gather(*(_stream(client, url, i, tokens) for i in range(streams)))
        elapsed = time.perf_counter() - start
        cpu = [_cpu_seconds(pid) - before for pid, before in zip(pids, cpu)]
    if sum(counts) < streams * tokens // 2:  # a chunk is a token, or a few when drafts were kept
        raise SystemExit(f"only {sum(counts)} chunks for {streams} streams of {tokens} tokens")
    total = streams * tokens
    return {"rate": total / elapsed, "server us": cpu[0] / total * 1e6, "core us": cpu[1] / total * 1e6}


def _measure(tree: Path, model: Path, tokens: int) -> dict[int, dict[str, float]]:
    server = _start(tree, model)
    try:
        pids = (server.pid, server.core_pid())
        return {n: asyncio.run(_load(server.url, n, tokens, pids)) for n in LOADS}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="a commit to serve in the same run (a temporary git worktree)")
    parser.add_argument("--rounds", type=int, help="servers started per tree, alternating (default 3; --quick 1)")
    parser.add_argument("--tokens", type=int, help="tokens a stream (default 256; --quick 32)")
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    args = parser.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.tokens = args.tokens or (32 if args.quick else 256)
    sys.path.insert(0, str(ROOT))
    from tests.support.models import tiny_llama_chat_model

    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_llama_chat_model(Path(tmp))
        runs = alternate(args.baseline, args.rounds, lambda tree: _measure(tree, model, args.tokens))
    _report(runs, args)


Runs = dict[str, list[dict[int, dict[str, float]]]]


def _report(runs: Runs, args: argparse.Namespace) -> None:
    from bench.machine import cpu_name

    names = list(runs)
    alternating = ", trees alternating" if len(names) > 1 else ""

    def med(name: str, n: int, key: str) -> float:
        return statistics.median(r[n][key] for r in runs[name])

    lines = [
        "# Streaming through the server, the tiny model",
        "",
        f"CPU: {cpu_name()}, {os.cpu_count()} logical CPUs; `python -m helexa.server` (engine core in its own "
        f"process, speculative decoding on: the defaults), the tiny test model; {args.tokens} tokens a stream, "
        f"greedy; {args.rounds} round(s) per tree, a fresh server each{alternating}. Tokens a second over all "
        "streams: best and median of the rounds; CPU a token (the median), the server's process and the core's.",
        "",
        "| streams | tree | tokens/s best | tokens/s median | server CPU us/token | core CPU us/token |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for n in LOADS:
        for name in names:
            best = max(r[n]["rate"] for r in runs[name])
            lines.append(f"| {n} | {name} | {best:,.0f} | {med(name, n, 'rate'):,.0f} | "
                         f"{med(name, n, 'server us'):.1f} | {med(name, n, 'core us'):.1f} |")  # fmt: skip
    lines += ["", "Every round (tokens/s; server, core CPU us/token):", ""]
    for name in names:
        rounds = "; ".join(
            " ".join(f"{n}: {r[n]['rate']:,.0f} ({r[n]['server us']:.0f}, {r[n]['core us']:.0f})" for n in LOADS)
            for r in runs[name]
        )
        lines.append(f"- {name}: {rounds}")
    text = "\n".join(lines) + "\n"
    print(text)
    OUT.mkdir(exist_ok=True)
    (OUT / "serve_streams.md").write_text(text)
    _plot(runs, OUT / "serve_streams.png")


def _plot(runs: Runs, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate, cpu) = plt.subplots(1, 2, figsize=(10, 4))
    for name, rs in runs.items():
        rate.plot(LOADS, [statistics.median(r[n]["rate"] for r in rs) for n in LOADS], marker="o", label=name)
        for key, style in (("server us", "-"), ("core us", "--")):
            values = [statistics.median(r[n][key] for r in rs) for n in LOADS]
            cpu.plot(LOADS, values, style, marker="o", label=f"{name}: {key.split()[0]}")
    for ax, label in ((rate, "tokens/s, all streams (median)"), (cpu, "CPU us per token (median)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
