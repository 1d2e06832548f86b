"""Many long sessions at once on one model: does the node hold them all, and in how much memory (issue 36).

The issue's target: the 8B shape serves 8 concurrent 4k-token sessions on a 24 GiB machine. This
runs what an agent harness does with such sessions: `--sessions` conversations whose context is
`--context` tokens each (different slices of this repository's docs, so no two share a block), in
two turns on one engine whose KV pool holds every session's whole sequence at once:

1. each session's context is submitted, all together, for one token (the prefill: one after another
   in chunks, since they all want the CPU);
2. each session comes back with its context plus that token and asks for `--new-tokens` more, all
   together: every session's context is in the pool (prefix cache, `cached_tokens`), so all of
   them decode together at that context, each step one token per session.

Greedy, EOS ignored. The model is a random-weight GGUF of the shape (`bench/random_gguf.py`, Q4_1 with
a Q8_0 tied head, as `bench/peers.py` runs it) or `135m`, the default model's file.

Reported: the machine's memory (MemTotal), the engine process's RSS at start, after load and at its
peak (VmHWM), the KV pool's bytes and dtype, the prefill's aggregate rate, the second turn's cached
tokens per session (all of the context when the pool held every session at once), whether all
sessions decoded at once (the last first token came before the first end) and their aggregate
decode rate meanwhile (the tokens whose time falls between the last first token and the first end,
over that window).

    python bench/long_sessions.py                                 # 8b, 8 sessions x 4096 tokens
    python bench/long_sessions.py --model 1b --sessions 4 --context 2048 --new-tokens 16

Writes `bench/results/long_sessions.md` and `bench/results/long_sessions.png` (each session's two
turns on a time line). Progress: a bar per turn.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from machine import cpu_name, memory_mib  # noqa: E402
from peers import RESULTS, convert_for_helexa, docs_prompts, load_tokenizer, model_gguf  # noqa: E402

from helexa import LLM, SamplingParams  # noqa: E402
from helexa.model.quant import native  # noqa: E402


def mem_total_gib() -> float:
    """This machine's memory, GiB (/proc/meminfo MemTotal)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="8b", help="135m, 1b or 8b")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--context", type=int, default=4096, help="prompt tokens per session")
    parser.add_argument("--new-tokens", type=int, default=32, help="the second turn's new tokens per session")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    gguf = model_gguf(args.model, args.threads)
    model_dir = convert_for_helexa(gguf)
    prompts = docs_prompts(load_tokenizer(), [args.context] * args.sessions)
    block_size = 16
    per_session = -(-(args.context + 1 + args.new_tokens + 1) // block_size)
    num_blocks = args.sessions * per_session + 16  # a little slack: a session's partial last block
    start = memory_mib()
    t0 = time.perf_counter()
    llm = LLM(
        model_dir,
        max_num_seqs=args.sessions,
        num_blocks=num_blocks,
        block_size=block_size,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    load_s = time.perf_counter() - t0
    loaded = memory_mib()
    budget = llm.engine.budget
    kv_bytes = budget.bytes_per_block * budget.num_blocks
    kv_dtype = str(llm.engine.pool.dtype).removeprefix("torch.")
    print(
        f"{gguf.name}: loaded in {load_s:.0f}s, RSS {loaded['rss']:.0f} MiB, KV pool {num_blocks} blocks "
        f"({kv_bytes / 2**30:.2f} GiB {kv_dtype}); {args.sessions} x {args.context} tokens submitted",
        flush=True,
    )
    t0 = time.perf_counter()
    firsts = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), use_tqdm=True)
    prefill_s = time.perf_counter() - t0
    turn2 = [p + o.token_ids for p, o in zip(prompts, firsts)]
    greedy = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    hits = llm.engine.counters.prefix_cache_hit_tokens
    spec = llm.engine.drafter.stats if llm.engine.drafter is not None else None
    drafted = spec.accepted_tokens if spec is not None else 0
    t1 = time.perf_counter()
    outs = llm.generate(turn2, greedy, use_tqdm=True)
    turn2_s, wall = time.perf_counter() - t1, time.perf_counter() - t0
    cached = llm.engine.counters.prefix_cache_hit_tokens - hits  # turn 2's prompt tokens found in the pool
    drafted = (spec.accepted_tokens if spec is not None else 0) - drafted  # tokens from accepted drafts
    end = memory_mib()
    llm.close()

    ttfts = [o.timings.ttft for o in outs]
    ends = [o.timings.total for o in outs]
    last_first, first_end = max(ttfts), min(ends)
    concurrent = last_first < first_end
    together = 0
    for o in outs:  # each token's time: the first at ttft, then the gaps
        when = o.timings.ttft
        for gap in o.timings.inter_token:
            when += gap
            together += last_first < when <= first_end
    window = first_end - last_first
    decode_rate = together / window if concurrent and window > 0 else None
    prefill_rate = sum(len(p) for p in prompts) / prefill_s

    live = f"all {args.sessions}" if concurrent else "NOT all (a session ended before the last first token)"
    lines = [
        f"# {args.sessions} concurrent sessions of {args.context} tokens — {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        f"CPU: {cpu_name()}, {args.threads} threads; helexa kernel path: {native.kernel_path()}; "
        f"machine memory (MemTotal) {mem_total_gib():.1f} GiB. Model: `{gguf.name}` "
        f"({gguf.stat().st_size / 2**30:.2f} GiB file). {args.new_tokens} new tokens per session, greedy, EOS "
        "ignored; prompts are different slices of this repository's docs (no shared blocks).",
        "",
        "| | |",
        "|---|---|",
        f"| sessions live at once | {live} |",
        f"| KV pool | {num_blocks} blocks, {kv_bytes / 2**30:.2f} GiB {kv_dtype} |",
        f"| process RSS at start / after load / peak | {start['rss']:.0f} / {loaded['rss']:.0f} / "
        f"{end['peak']:.0f} MiB ({end['peak'] / 1024:.2f} GiB) |",
        f"| load | {load_s:.0f} s |",
        f"| turn 1, every context prefilled | {prefill_s:.0f} s ({prefill_rate:.1f} tok/s aggregate) |",
        f"| turn 2, prompt tokens found cached | {cached:,} of {sum(map(len, turn2)):,} "
        f"({cached / args.sessions:.0f} per session) |",
        f"| turn 2, time to first token, first / last session | {min(ttfts):.2f} / {last_first:.2f} s |",
        f"| turn 2, decode, all {args.sessions} together at {args.context}+ tokens of context | "
        + ("—" if decode_rate is None else f"{decode_rate:.2f} tok/s aggregate ({together} tokens in {window:.1f} s)")
        + f"; of turn 2's {sum(len(o.token_ids) for o in outs)} tokens, {drafted} from accepted speculative drafts |",
        f"| wall time, turn 2 / both turns | {turn2_s:.0f} / {wall:.0f} s |",
    ]
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "long_sessions.md").write_text(text + "\n")
    plot(ttfts, ends, args.out / "long_sessions.png", f"turn 2: {args.sessions} x {args.context} tokens, {gguf.name}")
    print(f"wrote {args.out / 'long_sessions.md'} and {args.out / 'long_sessions.png'}")
    return 0 if concurrent and cached >= args.sessions * args.context else 1


def plot(ttfts: list[float], ends: list[float], path: Path, title: str) -> None:
    """Each session as a bar: submit to first token (prefill, waiting its turn), then decode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.5 * len(ttfts) + 1.5))
    for i, (first, end) in enumerate(zip(ttfts, ends)):
        ax.barh(i, first, color="C0", label="to first token" if i == 0 else None)
        ax.barh(i, end - first, left=first, color="C1", label="decoding" if i == 0 else None)
    ax.axvline(max(ttfts), color="grey", ls="--", lw=1)
    ax.set_xlabel("seconds since submit")
    ax.set_ylabel("session")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
