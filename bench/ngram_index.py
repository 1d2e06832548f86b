"""The prompt-lookup index (`helexa/engine/speculative/ngram.py`): its compiled tables against its Python dicts
on the same token lists, in one process, the two alternating.

The token lists are this repository's docs, tokenised by the default model's tokenizer (natural text: its
n-grams recur as a real prompt's do), sliced to each length of `--lengths`. Per length and kind of tables:

- held: what the index holds once it has indexed the prompt (`tracemalloc`: arrays and dicts alike), per
  token; the largest length's figure is what every drafting request holds per token of its context;
- index: one `extend` over the whole prompt (a request's first draft indexes its prompt), the median of
  `--repeats`;
- step: one decode step's work on the request's index: its list grows by the docs' next token, then
  `propose(tokens, 8)`, the median over `--steps` steps.

Then the session store (`SessionOutputs`, mode `suffix`) full to its default bounds: 16 sessions x 4 outputs of
4,000 tokens (16,004 a session with the separators, 256,064 in all), each session's index built by one
lookup: the bytes it holds.

    python bench/ngram_index.py
    python bench/ngram_index.py --lengths 1024,8192 --steps 2000 --repeats 3   # a quick run

Writes `bench/out/ngram_index.md`, `.png` and `.json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from machine import cpu_name  # noqa: E402
from peers import docs_text, load_tokenizer  # noqa: E402

from helexa.engine.speculative import SessionOutputs, ngram  # noqa: E402
from helexa.engine.speculative.ngram import NgramIndex  # noqa: E402

OUT = BENCH / "out"
KINDS = {"compiled": True, "dicts": False}


def held_bytes(tokens: list[int], native: bool) -> int:
    """Bytes an index of `tokens` holds (traced from an empty index to the indexed prompt)."""
    tracemalloc.start()
    try:
        index = NgramIndex(2, 4, native=native)
        before = tracemalloc.get_traced_memory()[0]
        index.extend(tokens)
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def index_seconds(tokens: list[int], native: bool, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        index = NgramIndex(2, 4, native=native)
        start = time.perf_counter()
        index.extend(tokens)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_seconds(ids: list[int], length: int, native: bool, steps: int) -> tuple[float, float]:
    """(median seconds of one decode step's append + propose, the share of steps that found a draft)."""
    tokens = ids[:length]
    index = NgramIndex(2, 4, native=native)
    index.extend(tokens)
    times, found = [], 0
    for i in range(steps):
        tokens.append(ids[length + i])
        start = time.perf_counter()
        draft = index.propose(tokens, 8)
        times.append(time.perf_counter() - start)
        found += bool(draft)
    return statistics.median(times), found / steps


def session_store_bytes(ids: list[int], native: bool, sessions_count: int) -> tuple[int, int]:
    """(bytes the session store holds at its default bounds, tokens kept)."""
    tracemalloc.start()
    try:
        store = SessionOutputs(native=native)
        for s in range(sessions_count):
            for turn in range(4):
                at = ((s * 4 + turn) * 4000) % (len(ids) - 4000)
                store.record(None, f"session-{s}", ids[at : at + 4000])
        for s in range(sessions_count):
            store.propose(None, f"session-{s}", ids[:4], 4)
        return tracemalloc.get_traced_memory()[0], store.num_tokens
    finally:
        tracemalloc.stop()


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"# The prompt-lookup index: compiled tables and Python dicts (CPU: {results['cpu']}; "
        f"tables: {results['path']})",
        "",
        f"n = 2..4; the default model's tokens of this repository's docs; index: median of {args.repeats}; "
        f"step: one token appended + `propose(k=8)`, median of {args.steps} steps.",
        "",
        "| tokens | held, compiled (B/token) | dicts | ratio | index, compiled (ms) | dicts | ratio "
        "| step, compiled (us) | dicts | ratio | steps with a draft |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results["lengths"]:
        c, d = row["compiled"], row["dicts"]
        lines.append(
            f"| {row['tokens']:,} | {c['held'] / row['tokens']:.1f} | {d['held'] / row['tokens']:.1f} "
            f"| {d['held'] / c['held']:.1f}x | {c['index'] * 1e3:.2f} | {d['index'] * 1e3:.2f} "
            f"| {d['index'] / c['index']:.1f}x | {c['step'] * 1e6:.2f} | {d['step'] * 1e6:.2f} "
            f"| {d['step'] / c['step']:.2f}x | {c['found']:.0%} |"
        )
    s = results["sessions"]
    lines += [
        "",
        f"Session store, {args.sessions} sessions x 4 outputs ({s['compiled']['tokens']:,} tokens kept): compiled "
        f"{s['compiled']['held'] / 2**20:.1f} MiB ({s['compiled']['held'] / s['compiled']['tokens']:.0f} B/token), "
        f"dicts {s['dicts']['held'] / 2**20:.1f} MiB ({s['dicts']['held'] / s['dicts']['tokens']:.0f} B/token).",
    ]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["lengths"]
    labels = [f"{r['tokens']:,}" for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, scale, title in (
        (axes[0], "held", None, "bytes held per token"),
        (axes[1], "index", 1e3, "indexing the prompt (ms)"),
        (axes[2], "step", 1e6, "one decode step (us)"),
    ):
        for i, kind in enumerate(KINDS):
            values = [r[kind][key] / r["tokens"] if scale is None else r[kind][key] * scale for r in rows]
            ax.bar([x + 0.4 * i for x in range(len(rows))], values, width=0.4, label=kind)
        ax.set_xticks([x + 0.2 for x in range(len(rows))], labels)
        ax.set_xlabel("prompt tokens")
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"prompt lookup, n = 2..4 ({results['cpu']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1024,8192,32768", help="prompt lengths, comma-separated")
    parser.add_argument("--steps", type=int, default=20000, help="decode steps timed per length and kind")
    parser.add_argument("--repeats", type=int, default=5, help="prompt indexings timed per length and kind")
    parser.add_argument("--sessions", type=int, default=16, help="sessions filling the store (16 fill it)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if not ngram.compiled_tables():
        raise SystemExit(f"the compiled tables are unavailable: {ngram.native_unavailable_reason()}")
    lengths = [int(n) for n in args.lengths.split(",") if n.strip()]
    ids = list(load_tokenizer().encode(docs_text()))
    if max(lengths) + args.steps > len(ids):
        raise SystemExit(f"the docs are {len(ids)} tokens: too few for {max(lengths)} + {args.steps} steps")
    results: dict[str, Any] = {"cpu": cpu_name(), "path": "compiled by cc -O2 (plain C)", "lengths": []}
    print(f"CPU {results['cpu']}; {len(ids)} tokens of docs", flush=True)
    for length in lengths:
        row: dict[str, Any] = {"tokens": length}
        for kind, native in KINDS.items():
            step, found = step_seconds(ids, length, native, args.steps)
            row[kind] = {
                "held": held_bytes(ids[:length], native),
                "index": index_seconds(ids[:length], native, args.repeats),
                "step": step,
                "found": found,
            }
            print(f"  {length:>6} tokens, {kind:>8}: {row[kind]}", flush=True)
        results["lengths"].append(row)
    results["sessions"] = {}
    for kind, native in KINDS.items():
        held, tokens = session_store_bytes(ids, native, args.sessions)
        results["sessions"][kind] = {"held": held, "tokens": tokens}
    text = report(results, args)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ngram_index.md").write_text(text + "\n")
    (args.out / "ngram_index.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out / "ngram_index.png")
    print(f"wrote {args.out / 'ngram_index.md'}, .png and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
