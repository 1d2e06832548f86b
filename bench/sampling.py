"""Decode speed of the default model on the CPU under each way of sampling an OpenAI client asks for: greedy,
temperature 1 (the SDK's default), temperature 0.7 with top-p 0.9, frequency/presence/repetition penalties,
and logprobs with 5 top tokens. Chat prompts (different ones, no prefix-cache hits), EOS ignored,
speculative decoding off (every step samples one row a sequence; `--speculative default` for the engine's
default: its drafts depend on each prompt's text, which differs between the rows), at 1 and 16 streams:
the aggregate decode tokens/s (tokens after the first over the time after the last first token), best of
`--rounds`.

With `--baseline COMMIT` the same runs of another commit's tree (a temporary git worktree) alternate with
this tree's in one run, each in a fresh process, and the table gives the ratio.

    python bench/sampling.py                         # this tree
    python bench/sampling.py --baseline 5f87549      # against another commit, same run

Prints the CPU and the kernel path; writes `bench/out/sampling.md` and `bench/out/sampling.png`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from trees import alternate, run_worker  # noqa: E402

OUT = ROOT / "bench" / "out"
# SamplingParams besides max_tokens and ignore_eos, by name.
MODES: dict[str, dict[str, object]] = {
    "greedy": {"temperature": 0.0},
    "temperature 1": {"temperature": 1.0},
    "top-p 0.9, temperature 0.7": {"temperature": 0.7, "top_p": 0.9},
    "penalties (frequency 0.5, presence 0.3, repetition 1.1)": {
        "temperature": 0.0,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.3,
        "repetition_penalty": 1.1,
    },
    "logprobs, 5 top": {"temperature": 0.0, "logprobs": 5},
}
PROMPTS = [
    "Write a haiku about a lighthouse in the fog.",
    "Explain what a hash map is to a ten-year-old.",
    "List three tips for keeping a sourdough starter alive.",
    "What is the difference between a list and a tuple in Python?",
    "Describe the water cycle in four sentences.",
    "Give me a short packing list for a weekend of hiking.",
    "Why is the sky blue? Answer briefly.",
    "Suggest a name for a small bakery and explain it.",
]


def _worker(args: argparse.Namespace) -> None:
    """This tree's measurements, as JSON on stdout (run with the tree first on PYTHONPATH)."""
    import helexa
    from helexa import LLM, SamplingParams
    from helexa.model.quant import native

    streams = [int(n) for n in args.streams.split(",")]
    spec = {} if args.speculative == "default" else {"speculative": args.speculative}
    llm = LLM(args.model, max_num_seqs=max(streams), **spec)
    try:
        tok = llm.tokenizer
        texts = [
            PROMPTS[i % len(PROMPTS)] + (f" ({i // len(PROMPTS)})" if i >= len(PROMPTS) else "") for i in range(64)
        ]
        prompts = [
            list(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)) for t in texts
        ]
        llm.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
        results: dict[str, float] = {}
        for name, fields in MODES.items():
            for n in streams:
                params = [
                    SamplingParams(max_tokens=args.tokens, ignore_eos=True, **fields)  # type: ignore[arg-type]
                    for _ in range(n)
                ]
                # a different slice of the prompts each time: no run finds the last one's prefix cached
                offset = (len(results) * n) % (len(prompts) - n + 1)
                outs = llm.generate(prompts[offset : offset + n], params, use_tqdm=False)
                window = max(o.timings.total for o in outs) - max(o.timings.ttft for o in outs)
                results[f"{name}/{n}"] = sum(len(o.token_ids) - 1 for o in outs) / window
    finally:
        llm.close()
    path = native.kernel_path() if native.available() else "none"
    print("RESULT " + json.dumps({"helexa": helexa.__file__, "path": path, "results": results}))


def _run_tree(tree: Path, args: argparse.Namespace) -> dict:
    argv = ["--model", args.model, "--tokens", str(args.tokens), "--streams", args.streams,
            "--speculative", args.speculative]  # fmt: skip
    return run_worker(tree, ROOT / "bench" / "sampling.py", argv)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model name or directory")
    parser.add_argument("--tokens", type=int, default=96, help="new tokens per stream")
    parser.add_argument("--streams", default="1,16", help="stream counts, comma-separated (at most 64)")
    parser.add_argument("--speculative", default="off", help="off (default), ngram, suffix, or default (the engine's)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per tree, alternating; each speed the best")
    parser.add_argument("--baseline", help="a commit to measure in the same run (a temporary git worktree)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    if not all(0 < int(n) <= 64 for n in args.streams.split(",")):
        parser.error("--streams: counts from 1 to 64")
    runs = alternate(args.baseline, args.rounds, lambda tree: _run_tree(tree, args))
    best = {name: {k: max(r["results"][k] for r in rs) for k in rs[0]["results"]} for name, rs in runs.items()}
    _report(best, runs[list(runs)[-1]][0]["path"], args)


def _report(best: dict[str, dict[str, float]], path: str, args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    from bench.machine import cpu_name

    names = list(best)
    streams = [int(n) for n in args.streams.split(",")]
    lines = [
        "# Decode tokens/s by sampling, CPU",
        "",
        f"CPU: {cpu_name()}, {os.cpu_count()} logical CPUs; kernel path {path}; model {args.model}; "
        f"{args.tokens} new tokens a stream, EOS ignored, speculative decoding {args.speculative}; chat prompts; "
        f"the best of {args.rounds} round(s) per tree" + (", trees run in alternation." if len(names) > 1 else "."),
        "",
        "| sampling | streams | " + " | ".join(f"tok/s ({n})" for n in names)
        + (" | ratio |" if len(names) > 1 else " |") + " % of greedy (" + names[-1] + ") |",
        "|---|---:|" + "---:|" * (len(names) + (len(names) > 1) + 1),
    ]  # fmt: skip
    mine = best[names[-1]]
    for mode in MODES:
        for n in streams:
            key = f"{mode}/{n}"
            speeds = [best[name][key] for name in names]
            ratio = f" {speeds[-1] / speeds[0]:.2f}x |" if len(names) > 1 else ""
            share = 100 * mine[key] / mine[f"greedy/{n}"]
            lines.append(f"| {mode} | {n} | " + " | ".join(f"{v:.1f}" for v in speeds) + f" |{ratio} {share:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    OUT.mkdir(exist_ok=True)
    (OUT / "sampling.md").write_text(text)
    _plot(best, streams, OUT / "sampling.png")


def _plot(best: dict[str, dict[str, float]], streams: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(streams), figsize=(5 * len(streams), 4))
    axes = axes if len(streams) > 1 else [axes]
    width = 0.8 / len(best)
    for ax, n in zip(axes, streams):
        for j, (name, res) in enumerate(best.items()):
            ax.bar([i + j * width for i in range(len(MODES))], [res[f"{m}/{n}"] for m in MODES], width, label=name)
        ax.set_xticks([i + width * (len(best) - 1) / 2 for i in range(len(MODES))])
        ax.set_xticklabels([m.split(" (")[0].split(",")[0] for m in MODES], rotation=20, fontsize=8)
        ax.set_title(f"{n} stream(s)")
        ax.set_ylabel("decode tok/s")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
