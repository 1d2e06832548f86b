"""Offline serving benchmark on the default model: helexa vs transformers `generate`, same prompts, same run.

Reports output tokens/s, time to first token and inter-token latency percentiles, prefill tokens/s,
and helexa's Python overhead per step separately from model time; prints one table with the
ratios against transformers and writes `bench/out/serve.md` and `bench/out/serve.png`.

    python bench/serve.py                      # 16 prompts x 64 tokens, fp32
    python bench/serve.py --dtype bfloat16     # the same in bf16 (CPU AMX / avx512_bf16)
    python bench/serve.py --quick              # a smoke run (4 prompts x 8 tokens)
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helexa import LLM, SamplingParams  # noqa: E402
from helexa.model.weights.pull import DEFAULT_MODEL, resolve_model  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
_WORDS = (
    "the agent reads the file then calls a tool and waits for the result before it writes a short plan "
    "with three steps about caching memory blocks latency queues and the next request in the session"
).split()


@dataclass
class Row:
    name: str
    tokens_per_s: float
    ttft_p50_ms: float | None = None
    ttft_p95_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p95_ms: float | None = None
    note: str = ""


def make_prompts(tokenizer, n: int, seed: int = 0, lo: int = 16, hi: int = 256) -> list[list[int]]:
    """Chat prompts with a realistic spread of lengths (log-uniform between `lo` and `hi` words)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        words = int(round(lo * (hi / lo) ** rng.random()))
        content = " ".join(rng.choice(_WORDS) for _ in range(words))
        prompts.append(
            tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        )
    return prompts


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")


def bench_helexa(llm: LLM, prompts: list[list[int]], max_tokens: int, long_prompt: list[int]) -> dict[str, Row]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm-up
    rows: dict[str, Row] = {}

    (single,) = llm.generate([prompts[0]], params, use_tqdm=False)
    itl = list(single.timings.inter_token)
    rows["single"] = Row(
        "helexa single stream decode",
        len(itl) / sum(itl),
        single.timings.ttft * 1e3,
        None,
        pct(itl, 0.5) * 1e3,
        pct(itl, 0.95) * 1e3,
    )

    counters = llm.engine.counters
    steps0, step_s0, model_s0 = counters.steps, counters.step_seconds, counters.model_seconds
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    wall = time.perf_counter() - start
    total = sum(len(o.token_ids) for o in outs)
    ttfts = [o.timings.ttft for o in outs]
    itls = [g for o in outs for g in o.timings.inter_token]
    steps = counters.steps - steps0
    overhead_ms = ((counters.step_seconds - step_s0) - (counters.model_seconds - model_s0)) / max(1, steps) * 1e3
    model_ms = (counters.model_seconds - model_s0) / max(1, steps) * 1e3
    rows["concurrent"] = Row(
        f"helexa {len(prompts)} concurrent (aggregate)",
        total / wall,
        pct(ttfts, 0.5) * 1e3,
        pct(ttfts, 0.95) * 1e3,
        pct(itls, 0.5) * 1e3,
        pct(itls, 0.95) * 1e3,
        f"{steps} steps; per step: model {model_ms:.1f} ms, python {overhead_ms:.1f} ms",
    )
    # Decode-only aggregate: once every prompt is in, each step emits one token per sequence.
    rows["concurrent_decode"] = Row(
        f"helexa {len(prompts)} concurrent decode-only",
        len(prompts) / pct(itls, 0.5),
        note="sequences / median inter-token gap",
    )

    (pre,) = llm.generate([long_prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    rows["prefill"] = Row(
        f"helexa prefill ({len(long_prompt)} tokens)", len(long_prompt) / pre.timings.ttft, pre.timings.ttft * 1e3
    )
    return rows


def bench_transformers(
    model_dir: Path,
    dtype: torch.dtype,
    prompts: list[list[int]],
    max_tokens: int,
    long_prompt: list[int],
    sequential: int,
) -> dict[str, Row]:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    pad = model.generation_config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad
    gen = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
    rows: dict[str, Row] = {}
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False, pad_token_id=pad)  # warm-up
        start = time.perf_counter()
        for p in tqdm(prompts[:sequential], desc="transformers batch-1", unit="req"):
            model.generate(torch.tensor([p]), **gen)
        wall = time.perf_counter() - start
        rows["hf_single"] = Row(
            "transformers batch-1 sequential", sequential * max_tokens / wall, note=f"{sequential} prompts"
        )

        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        start = time.perf_counter()
        with tqdm(total=1, desc=f"transformers static batch {len(prompts)}", unit="batch") as bar:
            model.generate(ids, attention_mask=mask, **gen)
            bar.update(1)
        wall = time.perf_counter() - start
        rows["hf_static"] = Row(f"transformers static batch {len(prompts)}", len(prompts) * max_tokens / wall)

        start = time.perf_counter()
        model(torch.tensor([long_prompt]))
        wall = time.perf_counter() - start
        rows["hf_prefill"] = Row(
            f"transformers prefill ({len(long_prompt)} tokens)", len(long_prompt) / wall, wall * 1e3
        )
    return rows


def fmt(v: float | None, digits: int = 1) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--hf-sequential", type=int, default=4, help="prompts run through transformers batch-1")
    ap.add_argument("--long-prompt", type=int, default=512, help="tokens in the prefill measurement")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 4 prompts x 8 tokens")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_prompts, args.max_tokens, args.hf_sequential, args.long_prompt = 4, 8, 1, 64

    model_dir = resolve_model(args.model)
    dtype = getattr(torch, args.dtype)
    llm = LLM(
        str(model_dir),
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        max_num_seqs=max(16, args.num_prompts),
        max_num_batched_tokens=2048,
        num_blocks=2048,
    )
    prompts = make_prompts(llm.tokenizer, args.num_prompts)
    rng = random.Random(1)
    long_prompt = [rng.randrange(100, 40000) for _ in range(args.long_prompt)]
    print(
        f"model={args.model} dtype={args.dtype} threads={torch.get_num_threads()} prompts={args.num_prompts} "
        f"prompt_tokens={sorted(len(p) for p in prompts)} max_tokens={args.max_tokens}"
    )

    h = bench_helexa(llm, prompts, args.max_tokens, long_prompt)
    del llm
    t = bench_transformers(model_dir, dtype, prompts, args.max_tokens, long_prompt, args.hf_sequential)

    ratios = [
        (
            "aggregate (concurrent) vs transformers batch-1",
            h["concurrent"].tokens_per_s / t["hf_single"].tokens_per_s,
            4.0,
        ),
        (
            "aggregate (concurrent) vs transformers static batch",
            h["concurrent"].tokens_per_s / t["hf_static"].tokens_per_s,
            1.5,
        ),
        ("single stream vs transformers batch-1", h["single"].tokens_per_s / t["hf_single"].tokens_per_s, 1.5),
        ("prefill vs transformers", h["prefill"].tokens_per_s / t["hf_prefill"].tokens_per_s, 1.0),
    ]
    lines = [
        f"# serve benchmark — {time.strftime('%Y-%m-%d')}, {args.model}, {args.dtype}, CPU "
        f"({torch.get_num_threads()} threads)",
        "",
        "| run | tok/s | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | ITL p95 ms | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in list(h.values()) + list(t.values()):
        lines.append(
            f"| {row.name} | {fmt(row.tokens_per_s)} | {fmt(row.ttft_p50_ms)} | {fmt(row.ttft_p95_ms)} | "
            f"{fmt(row.itl_p50_ms)} | {fmt(row.itl_p95_ms)} | {row.note} |"
        )
    lines += ["", "| ratio | measured | target |", "|---|---|---|"]
    lines += [f"| {name} | {value:.2f}x | >= {target}x |" for name, value, target in ratios]
    table = "\n".join(lines)
    print(table)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "serve.md").write_text(table + "\n")
    _plot(list(h.values()) + list(t.values()), ratios, OUT / "serve.png", args)
    print(f"wrote {OUT / 'serve.md'} and {OUT / 'serve.png'}")
    return 0


def _plot(rows: list[Row], ratios, path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    names = [r.name for r in rows]
    ax1.barh(
        names,
        [r.tokens_per_s for r in rows],
        color=["tab:blue" if n.startswith("helexa") else "tab:gray" for n in names],
    )
    ax1.set_xlabel("tokens / s")
    ax1.set_title(f"{args.model} {args.dtype} on CPU")
    ax1.invert_yaxis()
    ax2.barh([r[0] for r in ratios], [r[1] for r in ratios], color="tab:green")
    for i, (_, _, target) in enumerate(ratios):
        ax2.plot([target, target], [i - 0.4, i + 0.4], color="tab:red")
    ax2.set_xlabel("helexa / transformers (red: target)")
    ax2.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
