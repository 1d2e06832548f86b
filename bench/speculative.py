"""Speculative decoding on agent sessions that copy, and on chat that does not: decode tok/s, TTFT, acceptance.

Two workloads, each replayed at 1, 4 and 16 concurrent streams, without and with speculative decoding
(`--speculative off` vs the mode under test, default `suffix`), on fresh engines in the same process,
the two modes alternating so both see the same machine:

- **copy**: a coding agent reads a real file of the Python standard library (`colorsys.py`, `bisect.py`,
  `genericpath.py`, `fnmatch.py`; one per stream), then asks for edits of it, each turn resending the
  whole conversation and asking for the whole file again (greedy, as agents run; `prompt_cache_key`
  names the session);
- **chat**: questions that nothing in the prompt answers, one after another on each stream (seeded
  sampling, temperature 0.7, top_p 0.9, as chat clients run).

Greedy and seeded answers do not depend on speculation, so both modes generate the same tokens (checked:
every answer is compared). Per run: decode tok/s (each request's tokens after the first over the time
from its first token to its last, summed over concurrent streams), TTFT, and speculation's acceptance
rate and tokens kept per draft.

    python bench/speculative.py                # the default model, 3 turns of up to 256 tokens
    python bench/speculative.py --quick        # 1 and 4 streams, 2 turns of 96 tokens: a smoke run

Writes `bench/out/speculative.md` (the table, the CPU, the kernel path, the targets) and
`bench/out/speculative.png`.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import cpu_name  # noqa: E402
from helexa.config import EngineConfig  # noqa: E402
from helexa.engine.engine import Engine  # noqa: E402
from helexa.model.quant import native as native_kernels  # noqa: E402
from helexa.model.sampling import SamplingParams  # noqa: E402
from helexa.values import parse_size  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
FILES = ("colorsys", "bisect", "genericpath", "fnmatch")
EDITS = (
    "Rewrite the whole file with one change: add a comment line '# Reviewed by the agent.' at the very top. "
    "Output the complete file in one Python code block.",
    "Now also rename every local variable called 'x' or 'a' to 'value'. Output the complete file again.",
    "Now remove the module docstring. Output the complete file again.",
    "Now add a blank line at the end of every function. Output the complete file again.",
)
QUESTIONS = (
    "Write a short poem about a lighthouse keeper who cannot sleep.",
    "What are three good habits for a new programmer? Explain each briefly.",
    "Describe the taste of a lemon to someone who has never had one.",
    "Plan a rainy Sunday afternoon for two children aged six and nine.",
    "Why do cats purr? Give a short answer.",
    "Tell me a story about a robot that learns to paint.",
    "What should I pack for a week of hiking in autumn?",
    "Explain what a rainbow is to a five year old.",
)


def source(name: str, chars: int) -> str:
    """The first `chars` characters of a standard-library module's source, cut at a line end."""
    text = Path(importlib.import_module(name).__file__ or "").read_text()
    return text[: text.rfind("\n", 0, chars) + 1] if len(text) > chars else text


@dataclass
class Answer:
    tokens: list[int]
    ttft: float
    first: float  # when its first token came (monotonic)
    last: float  # when its last token came

    @property
    def decode_seconds(self) -> float:
        return self.last - self.first


@dataclass
class Run:
    workload: str
    streams: int
    mode: str
    wall: float = 0.0
    answers: list[list[Answer]] = field(default_factory=list)  # per stream, per turn
    spec: dict[str, float] = field(default_factory=dict)

    @property
    def flat(self) -> list[Answer]:
        return [a for stream in self.answers for a in stream]

    @property
    def decode_tok_s(self) -> float:
        """Each stream's decode rate (tokens after the first / seconds from first to last), summed over streams."""
        per_stream = []
        for stream in self.answers:
            tokens = sum(len(a.tokens) - 1 for a in stream)
            seconds = sum(a.decode_seconds for a in stream)
            per_stream.append(tokens / seconds if seconds > 0 else 0.0)
        return sum(per_stream)

    @property
    def ttft(self) -> float:
        return statistics.median(a.ttft for a in self.flat)


def ask(engine: Engine, prompt: list[int], params: SamplingParams, session: str | None) -> Answer:
    start = time.monotonic()
    handle = engine.submit(prompt, params, prompt_cache_key=session)
    tokens: list[int] = []
    first = last = 0.0
    for event in handle.stream:
        if event.error is not None:
            raise RuntimeError(f"request failed: {event.error}")
        if event.token_ids:
            last = time.monotonic()
            first = first or last
            tokens.extend(event.token_ids)
        if event.finished:
            break
    return Answer(tokens, first - start, first, last)


def copy_session(engine: Engine, stream: int, args: argparse.Namespace, out: list[Answer], bar: tqdm) -> None:
    name = FILES[stream % len(FILES)]
    messages = [
        {"role": "system", "content": "You are a careful coding agent. You edit files exactly as asked."},
        {"role": "user", "content": f"Here is `{name}.py`:\n```python\n{source(name, args.file_chars)}```\n{EDITS[0]}"},
    ]
    for turn in range(args.turns):
        prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        params = SamplingParams(max_tokens=args.answer_tokens, temperature=0.0)
        answer = ask(engine, prompt, params, f"agent-{stream}")
        out.append(answer)
        bar.update()
        text = engine.tokenizer.decode(answer.tokens, skip_special_tokens=True)
        edit = EDITS[(turn + 1) % len(EDITS)]
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": edit}]


def chat_session(engine: Engine, stream: int, args: argparse.Namespace, out: list[Answer], bar: tqdm) -> None:
    for turn in range(args.turns):  # one new question a turn, each its own conversation
        question = QUESTIONS[(stream + turn * 3) % len(QUESTIONS)]
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True
        )
        params = SamplingParams(
            max_tokens=args.answer_tokens, temperature=0.7, top_p=0.9, seed=1000 + 31 * stream + turn
        )
        out.append(ask(engine, prompt, params, None))
        bar.update()


def run(args: argparse.Namespace, workload: str, streams: int, mode: str) -> Run:
    config = EngineConfig.of(
        model=args.model, device="cpu", speculative=mode, max_num_seqs=max(16, streams),
        kv_cache_memory=parse_size(args.kv_cache_memory), num_speculative_tokens=args.num_speculative_tokens,
    )  # fmt: skip
    engine = Engine(config)
    args.native = engine.runner is not None and engine.runner.model.native_step is not None
    engine.start()
    result = Run(workload, streams, mode, answers=[[] for _ in range(streams)])
    session = copy_session if workload == "copy" else chat_session
    turns = args.turns
    start = time.monotonic()
    with tqdm(total=streams * turns, desc=f"{workload} x{streams} speculative={mode}", leave=False) as bar:
        threads = [
            threading.Thread(target=session, args=(engine, i, args, result.answers[i], bar), daemon=True)
            for i in range(streams)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=3600)
    result.wall = time.monotonic() - start
    snap = engine.snapshot()
    result.spec = {k: snap[k] for k in ("spec_acceptance_rate", "spec_mean_accepted_length", "spec_draft_tokens")}
    engine.shutdown()
    return result


def report(runs: dict[tuple[str, int, str], Run], args: argparse.Namespace, identical: bool) -> str:
    native = f"the fused C step on helexa's {native_kernels.kernel_path()} kernels" if args.native else "torch layers"
    lines = [
        "# Speculative decoding: agent sessions that copy, chat that does not",
        "",
        f"CPU: {cpu_name()} ({torch.get_num_threads()} threads); model: {args.model or 'smollm2-135m-instruct'} "
        f"(its GGUF), kernel path: {native}; mode under test: `--speculative {args.mode}`, "
        f"`--num-speculative-tokens {args.num_speculative_tokens}`.",
        f"copy: {args.turns} turns of up to {args.answer_tokens} tokens per stream, files of {args.file_chars} chars; "
        f"chat: {args.turns} questions of up to {args.answer_tokens} tokens per stream.",
        f"Every answer identical with and without speculation: {'yes' if identical else 'NO'}.",
        "",
        "| workload | streams | decode tok/s off | decode tok/s on | speed-up | TTFT p50 off (s) | TTFT p50 on (s) "
        "| acceptance | tokens kept per draft | wall off / on (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for workload in ("copy", "chat"):
        for streams in args.streams:
            off, on = runs.get((workload, streams, "off")), runs.get((workload, streams, args.mode))
            if off is None or on is None:
                continue
            lines.append(
                f"| {workload} | {streams} | {off.decode_tok_s:.1f} | {on.decode_tok_s:.1f} | "
                f"{on.decode_tok_s / off.decode_tok_s:.2f}x | {off.ttft:.2f} | {on.ttft:.2f} | "
                f"{on.spec['spec_acceptance_rate']:.2f} | {on.spec['spec_mean_accepted_length']:.2f} | "
                f"{off.wall:.1f} / {on.wall:.1f} |"
            )
    lines += [
        "",
        "Targets (issue 32): >= 2x decode tok/s on the copying sessions at 1 and 4 streams; no workload more "
        "than 3% slower with speculation than without.",
    ]
    return "\n".join(lines) + "\n"


def plot(runs: dict[tuple[str, int, str], Run], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, workload in zip(axes, ("copy", "chat")):
        xs = [s for s in args.streams if (workload, s, "off") in runs and (workload, s, args.mode) in runs]
        width = 0.38
        for k, mode in enumerate(("off", args.mode)):
            ax.bar(
                [i + (k - 0.5) * width for i in range(len(xs))],
                [runs[(workload, s, mode)].decode_tok_s for s in xs],
                width,
                label=f"speculative {mode}",
            )
        ax.set_xticks(range(len(xs)), [f"{s} streams" for s in xs])
        ax.set_ylabel("decode tok/s (all streams)")
        ax.set_title(f"{workload}")
        ax.legend()
    fig.suptitle(f"Speculative decoding, {cpu_name()}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model (default: the default model)")
    parser.add_argument("--mode", default="suffix", choices=["ngram", "suffix"])
    parser.add_argument("--num-speculative-tokens", type=int, default=8)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--answer-tokens", type=int, default=256)
    parser.add_argument("--file-chars", type=int, default=2500)
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--workloads", nargs="+", default=["copy", "chat"], choices=["copy", "chat"])
    parser.add_argument("--quick", action="store_true", help="1 and 4 streams, 2 turns of 96 tokens")
    args = parser.parse_args()
    if args.quick:
        args.streams, args.turns, args.answer_tokens = [1, 4], 2, 96
    OUT.mkdir(exist_ok=True)
    runs: dict[tuple[str, int, str], Run] = {}
    identical = True
    for workload in args.workloads:
        for streams in args.streams:
            for mode in ("off", args.mode):  # alternating: both modes see the same machine
                runs[(workload, streams, mode)] = r = run(args, workload, streams, mode)
                print(f"{workload} x{streams} {mode}: {r.decode_tok_s:.1f} decode tok/s, TTFT p50 {r.ttft:.2f}s, "
                      f"wall {r.wall:.1f}s {r.spec if mode != 'off' else ''}", flush=True)  # fmt: skip
            off, on = runs[(workload, streams, "off")], runs[(workload, streams, args.mode)]
            identical &= [a.tokens for a in off.flat] == [a.tokens for a in on.flat]
    text = report(runs, args, identical)
    (OUT / "speculative.md").write_text(text)
    plot(runs, args, OUT / "speculative.png")
    print(text)


if __name__ == "__main__":
    main()
