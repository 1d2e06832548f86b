"""Agent sessions whose KV together is 4x the pool: with and without a disk tier below it, and all resident.

8 sessions x 10 turns, each session its own system prompt and task (so little is shared between sessions),
each turn resending the whole conversation with `prompt_cache_key`, then "thinking" (a tool call) for a
random 1-3 s before the next. Three engines run one after another in the same process, the same sessions
(greedy, so the same conversations):

    resident     a pool that holds every session's KV: the best the prefix cache can do
    pool only    a pool of 1/4 of that, no tier: evicted sessions prefill everything again
    pool + disk  the same small pool with --kv-disk-path: evicted blocks go to disk and come back

Measured per turn: TTFT (and how much of it was a wait in admission's queue for pool room), prompt tokens
served from the cache (hit rate); per configuration the tier traffic and the time of every step that ran no
prompt token, compared between configurations at the same batch shape (decoding sequences, rows with drafts).
Targets (issue 33): hit rate >= 90% of resident; median turn TTFT <= 1.5x resident; decode step time unchanged
within noise.

    python bench/agent_tiers.py            # the default model (SmolLM2-135M-Instruct, Q4_1: the fused C step)
    python bench/agent_tiers.py --quick    # 3 sessions x 4 turns: a smoke run

Writes `bench/out/agent_tiers.md` and `bench/out/agent_tiers.png`.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent import _TASKS, Turn, tool_result  # noqa: E402
from test_bench_step import cpu_name  # noqa: E402

from helexa.config import EngineConfig  # noqa: E402
from helexa.engine.engine import Engine  # noqa: E402
from helexa.model.quant import native  # noqa: E402
from helexa.model.sampling import SamplingParams  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
CONFIGS = ("resident", "pool only", "pool + disk")


@dataclass
class Run:
    name: str
    wall: float = 0.0
    turns: list[list[Turn]] = field(default_factory=list)  # per session
    gaps: list[float] = field(default_factory=list)  # seconds between consecutive streamed tokens
    # steps that ran no prompt token: ((decoding sequences, rows with their drafts), seconds)
    decode_steps: list[tuple[tuple[int, int], float]] = field(default_factory=list)
    waits: list[tuple[float, float]] = field(default_factory=list)  # each turn's (TTFT, seconds in admission's queue)
    tiers: dict = field(default_factory=dict)
    evictions: int = 0
    kernel_path: str = ""

    def all_turns(self) -> list[Turn]:
        return [t for s in self.turns for t in s]

    def hit_rate(self) -> float:
        turns = self.all_turns()
        return sum(t.cached_tokens for t in turns) / sum(t.prompt_tokens for t in turns)


def system_prompt(session: int, tokens: int, rng: random.Random) -> str:
    """A session's own system prompt (a role and a project description of about `tokens` tokens)."""
    words = "module parser cache queue worker table index stream buffer client server schema token".split()
    lines = [f"You are coding agent #{session} working in repository project-{session}."]
    while len(" ".join(lines)) < tokens * 4:
        lines.append(" ".join(rng.choice(words) for _ in range(12)) + ".")
    return "\n".join(lines)


def run_session(
    engine: Engine,
    session: int,
    args: argparse.Namespace,
    out: list[Turn],
    gaps: list[float],
    waits: list[tuple[float, float]],
) -> None:
    rng = random.Random(1000 + session)
    messages = [
        {"role": "system", "content": system_prompt(session, args.system_tokens, rng)},
        {"role": "user", "content": rng.choice(_TASKS)},
    ]
    for k in range(args.turns):
        prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        start = time.monotonic()
        handle = engine.submit(
            prompt, SamplingParams(max_tokens=args.answer_tokens, temperature=0.0), prompt_cache_key=f"s{session}"
        )
        first, last, text, cached = None, None, [], 0
        for event in handle.stream:
            now = time.monotonic()
            if event.token_ids:
                if first is None:
                    first = now - start
                elif last is not None:
                    gaps.append(now - last)
                last = now
            text.append(event.text)
            cached = max(cached, event.num_cached_tokens)
            if event.finished:
                if event.error is not None:
                    raise RuntimeError(f"session {session} turn {k + 1} failed: {event.error}")
                break
        out.append(Turn(len(prompt), cached, first if first is not None else time.monotonic() - start))
        waits.append((out[-1].ttft, handle.ticket.waited_seconds or 0.0))
        messages.append({"role": "assistant", "content": "".join(text)})
        result = tool_result(rng, k).splitlines()[: 1 + args.tool_lines]  # a short tool output: ~80 tokens
        messages.append({"role": "user", "content": "\n".join(result)})
        time.sleep(rng.uniform(*args.think))


def run(args: argparse.Namespace, name: str, pool_tokens: int, disk: str | None) -> Run:
    config = EngineConfig.of(
        device="cpu", dtype="float32", block_size=16, num_blocks=pool_tokens // 16, max_num_seqs=args.sessions,
        max_num_batched_tokens=2048, kv_disk_path=disk, kv_disk_bytes=args.disk_bytes if disk else None,
    )  # fmt: skip
    engine = Engine(config)
    result = Run(name, turns=[[] for _ in range(args.sessions)])
    record = engine._record

    def timed(inputs, cadence, step_seconds, model_seconds, decode_yield=1.0):  # every step's own time
        if inputs.num_prefill_tokens == 0 and inputs.num_decode_seqs > 0:
            result.decode_steps.append(((inputs.num_decode_seqs, inputs.num_decode_tokens), step_seconds))
        record(inputs, cadence, step_seconds, model_seconds, decode_yield)

    engine._record = timed  # type: ignore[method-assign]
    engine.start()
    result.kernel_path = "fused C step (csrc/step.c)" if engine.runner.model.native_step is not None else "torch layers"
    start = time.monotonic()
    threads = [
        threading.Thread(target=run_session, args=(engine, i, args, out, result.gaps, result.waits))
        for i, out in enumerate(result.turns)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.wall = time.monotonic() - start
    snap = engine.snapshot()
    result.tiers, result.evictions = snap["kv_tiers"], engine.kv.evictions
    result.tiers["load_bytes_per_second"] = snap["kv_tier_load_bytes_per_second"]
    engine.shutdown()
    if any(len(s) != args.turns for s in result.turns):
        raise RuntimeError(f"{name}: a session did not finish (see the log)")
    print(f"{name}: {result.wall:.1f}s, hit rate {result.hit_rate():.1%}, evictions {result.evictions}", flush=True)
    return result


def report(
    runs: dict[str, Run], args: argparse.Namespace, pool_tokens: int, total_tokens: int, rounds: list[dict[str, Run]]
) -> str:
    res, few, disk = (runs[n] for n in CONFIGS)  # every round's sessions together
    med = {n: statistics.median(t.ttft for t in r.all_turns()) for n, r in runs.items()}
    lines = [
        "# Agent sessions over a pool 4x too small: a disk tier below it vs none vs all resident",
        "",
        f"CPU: {cpu_name()}, {torch.get_num_threads()} threads; kernel path: {res.kernel_path}; native quant kernel "
        f"{'available' if native.available() else 'unavailable: ' + native.unavailable_reason()}. "
        f"Default model (SmolLM2-135M-Instruct, Q4_1), float32 KV, 16-token blocks. {args.sessions} sessions x "
        f"{args.turns} turns, think time {args.think[0]:g}-{args.think[1]:g} s, answers of at most "
        f"{args.answer_tokens} tokens; the sessions' KV at the end: {total_tokens} tokens, the small pool "
        f"{pool_tokens} tokens ({total_tokens / pool_tokens:.1f}x).",
        "",
        "| | resident | pool only | pool + disk |",
        "|---|---|---|---|",
        f"| hit rate (cached / prompt tokens) | {res.hit_rate():.1%} | {few.hit_rate():.1%} | {disk.hit_rate():.1%} |",
        f"| median turn TTFT | {med['resident']:.2f} s | {med['pool only']:.2f} s | {med['pool + disk']:.2f} s |",
        "| p90 turn TTFT | "
        + " | ".join(f"{_pct([t.ttft for t in r.all_turns()], 0.9):.2f} s" for r in runs.values())
        + " |",
        "| of which waiting for pool room (median, p90) | "
        + " | ".join(
            f"{statistics.median(w for _, w in r.waits):.2f} s, {_pct([w for _, w in r.waits], 0.9):.2f} s"
            for r in runs.values()
        )
        + " |",
        "| median TTFT after the grant (load or compute, first token) | "
        + " | ".join(f"{statistics.median(after_grant(r)):.2f} s" for r in runs.values())
        + " |",
        "| median decode-only step (steps that ran no prompt token) | "
        + " | ".join(
            f"{statistics.median(t for _, t in r.decode_steps) * 1e3:.1f} ms" if r.decode_steps else "-"
            for r in runs.values()
        )
        + " |",
        "| its mean batch (decoding sequences) | "
        + " | ".join(
            f"{statistics.mean(n for (n, _), _ in r.decode_steps):.1f}" if r.decode_steps else "-"
            for r in runs.values()
        )
        + " |",
        f"| wall time | {res.wall:.1f} s | {few.wall:.1f} s | {disk.wall:.1f} s |",
        f"| pool evictions (blocks) | {res.evictions} | {few.evictions} | {disk.evictions} |",
        "",
    ]
    d = disk.tiers.get("disk", {})
    bw = disk.tiers.get("load_bytes_per_second")
    lines += [
        f"Disk tier: {d.get('writes', 0)} blocks written, {d.get('loads', 0)} loaded ({d.get('hits', 0)} found), "
        f"{d.get('drops', 0)} dropped, {d.get('failures', 0)} failures; {d.get('blocks', 0)} blocks "
        f"({d.get('bytes', 0) / 2**20:.0f} MiB) at the end; load bandwidth "
        f"{bw / 2**30:.2f} GiB/s."
        if bw
        else "Disk tier: no loads.",
        "",
        "| turn | prompt tokens | hit: resident / pool only / + disk | TTFT: resident / pool only / + disk |",
        "|---|---|---|---|",
    ]
    for k in range(args.turns):
        per = {n: [s[k] for s in r.turns] for n, r in runs.items()}
        prompt = statistics.median(t.prompt_tokens for t in per["resident"])
        hits = " / ".join(
            f"{sum(t.cached_tokens for t in v) / sum(t.prompt_tokens for t in v):.0%}" for v in per.values()
        )
        ttfts = " / ".join(f"{statistics.median(t.ttft for t in v):.2f}" for v in per.values())
        lines.append(f"| {k + 1} | {prompt:.0f} | {hits} | {ttfts} s |")
    lines += ["", "Each round's ratios to its own resident run (the rounds ran in turn, in this order):", ""]
    lines += ["| round | hit rate + disk / resident | median TTFT + disk / resident | pool only / resident | "
              "TTFT after the grant + disk / resident | decode-only step + disk / pool only |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for i, rd in enumerate(rounds, 1):
        m = {n: statistics.median(t.ttft for t in r.all_turns()) for n, r in rd.items()}
        lines.append(
            f"| {i} | {rd['pool + disk'].hit_rate() / rd['resident'].hit_rate():.1%} | "
            f"{m['pool + disk'] / m['resident']:.2f}x | {m['pool only'] / m['resident']:.2f}x | "
            f"{_median_after_grant(rd['pool + disk']) / _median_after_grant(rd['resident']):.2f}x | "
            f"{_ratio(decode_step_ratio(rd['pool + disk'], rd['pool only']))} |"
        )
    hit_ok = disk.hit_rate() >= 0.9 * res.hit_rate()
    ttft_ok = med["pool + disk"] <= 1.5 * med["resident"]
    lines += [
        "",
        "## Targets",
        "",
        f"- hit rate >= 90% of resident: {disk.hit_rate() / res.hit_rate():.1%} of it — "
        f"{'met' if hit_ok else 'NOT met'}",
        f"- median turn TTFT <= 1.5x resident: {med['pool + disk'] / med['resident']:.2f}x — "
        f"{'met' if ttft_ok else 'NOT met'} (pool only: {med['pool only'] / med['resident']:.2f}x); after the "
        f"grant (the wait for pool room left out): {_median_after_grant(disk) / _median_after_grant(res):.2f}x "
        f"(pool only {_median_after_grant(few) / _median_after_grant(res):.2f}x)",
        "- decode step time unchanged: pool + disk / pool only (the same pool), decode-only steps of the same "
        f"batch shape: {_ratio(decode_step_ratio(disk, few))}; pool + disk / resident: "
        f"{_ratio(decode_step_ratio(disk, res))}",
        "",
    ]
    return "\n".join(lines)


def decode_step_ratio(run: Run, base: Run, least: int = 3) -> tuple[float | None, int]:
    """`run`'s decode-only step time over `base`'s for the same work: per batch shape (decoding sequences, and
    rows with their speculative drafts) seen at least `least` times in both, the ratio of the medians; their
    geometric mean weighted by the smaller count. Returns it and the steps compared (None, 0 when no shape was
    seen often enough in both)."""

    def by_size(r: Run) -> dict[tuple[int, int], list[float]]:
        out: dict[tuple[int, int], list[float]] = {}
        for n, t in r.decode_steps:
            out.setdefault(n, []).append(t)
        return out

    a, b = by_size(run), by_size(base)
    logs, weights = 0.0, 0
    for n in set(a) & set(b):
        w = min(len(a[n]), len(b[n]))
        if w >= least:
            logs += w * math.log(statistics.median(a[n]) / statistics.median(b[n]))
            weights += w
    return (math.exp(logs / weights) if weights else None), weights


def after_grant(run: Run) -> list[float]:
    """Each turn's TTFT less its wait in admission's queue: its load or prefill and first token."""
    return [ttft - wait for ttft, wait in run.waits]


def _median_after_grant(run: Run) -> float:
    return statistics.median(after_grant(run))


def _ratio(measured: tuple[float | None, int]) -> str:
    ratio, steps = measured
    return f"{ratio:.2f}x over {steps} steps" if ratio is not None else "too few comparable steps"


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def plot(runs: dict[str, Run], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    x = list(range(1, args.turns + 1))
    for name, r in runs.items():
        per = [[s[k] for s in r.turns] for k in range(args.turns)]
        axes[0].plot(x, [statistics.median(t.ttft for t in v) for v in per], marker="o", label=name)
        axes[1].plot(x, [sum(t.cached_tokens for t in v) / sum(t.prompt_tokens for t in v) for v in per],
                     marker="o", label=name)  # fmt: skip
    axes[0].set(xlabel="turn", ylabel="TTFT (s, median over sessions)", title="time to first token per turn")
    axes[1].set(xlabel="turn", ylabel="prompt tokens served from cache or tier", title="hit rate per turn")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle(f"{args.sessions} agent sessions, KV 4x the pool — {cpu_name()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--system-tokens", type=int, default=300)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--think", type=float, nargs=2, default=(1.0, 3.0), metavar=("MIN", "MAX"))
    parser.add_argument("--ratio", type=float, default=4.0, help="the sessions' KV over the small pool")
    parser.add_argument("--disk-bytes", type=int, default=8 << 30)
    parser.add_argument("--tool-lines", type=int, default=6, help="lines of each tool result")
    parser.add_argument("--resident-tokens", type=int, default=24576, help="the resident pool (all sessions fit)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--rounds", type=int, default=2, help="times the three configurations run, in turn")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.sessions, args.turns, args.think, args.rounds = 3, 4, (0.2, 0.5), 1
    torch.set_num_threads(args.threads)
    OUT.mkdir(exist_ok=True)
    rounds: list[dict[str, Run]] = []
    for r in range(args.rounds):  # the three configurations in turn, `rounds` times: drift hits each alike
        runs: dict[str, Run] = {}
        runs["resident"] = run(args, "resident", args.resident_tokens, None)  # nothing is ever evicted
        if runs["resident"].evictions:
            raise RuntimeError("the resident pool evicted: raise --resident-tokens")
        total = sum(s[-1].prompt_tokens + args.answer_tokens for s in runs["resident"].turns)
        largest = max(s[-1].prompt_tokens + args.answer_tokens for s in runs["resident"].turns)
        pool_tokens = int(max(total / args.ratio, 1.25 * largest)) // 16 * 16  # (a session's last turn must fit)
        runs["pool only"] = run(args, "pool only", pool_tokens, None)
        with tempfile.TemporaryDirectory(prefix="helexa-kv-") as disk:
            runs["pool + disk"] = run(args, "pool + disk", pool_tokens, disk)
        rounds.append(runs)
        merged = {name: _merge([rd[name] for rd in rounds]) for name in CONFIGS}
        text = report(merged, args, pool_tokens, total, rounds)
        print(text, flush=True)
        (OUT / "agent_tiers.md").write_text(text)
        plot(merged, args, OUT / "agent_tiers.png")
        print(f"round {r + 1}: wrote {OUT / 'agent_tiers.md'} and .png", flush=True)


def _merge(runs: list[Run]) -> Run:
    """One configuration's rounds as one run (every session of every round)."""
    out = Run(runs[0].name, kernel_path=runs[0].kernel_path, tiers=runs[-1].tiers)
    for r in runs:
        out.wall += r.wall / len(runs)
        out.turns += r.turns
        out.gaps += r.gaps
        out.decode_steps += r.decode_steps
        out.waits += r.waits
        out.evictions += r.evictions
    return out


if __name__ == "__main__":
    main()
