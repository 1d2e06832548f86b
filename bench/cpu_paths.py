"""The native CPU kernels per instruction-set path, and the memory a quantized model holds (issue 36).

0. The quantized GEMM alone (`native.int4_gemm`, `native.int8_gemm`) on an (16384, 4096) weight, far
   larger than the caches, at 1, 8 and 64 rows, on every path, alternating; GB/s of weight read.
1. Steps of a model (default: SmolLM2-135M from its Q4_1 GGUF) through the fused C step on every
   path this CPU runs (`helexa.model.quant.isa`), in one process on the same weights and cache,
   the paths alternating round by round (the machine is shared: each round measures every path
   back to back); the median per path and its speed against `avx2`.
2. Peak RSS (VmHWM) and RSS after loading the model and running one decode step, in a fresh
   process per measurement, for this tree and, with `--baseline DIR` (a checkout of the code before,
   e.g. `git archive main | tar -x -C /tmp/base`), that tree: alternating, `--rss-rounds` each.

    python bench/cpu_paths.py [--model PATH] [--baseline /tmp/base] [--threads 2]

Prints the CPU model and the path the process chose; writes `bench/results/cpu_paths.md` and `.png`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.machine import cpu_name  # noqa: E402
from helexa.engine.loading import kv_cache_dtype  # noqa: E402
from helexa.model.loader import load_model  # noqa: E402
from helexa.model.quant import isa, native, quantize_int4, quantize_int8  # noqa: E402
from helexa.model.transformer import CausalLM  # noqa: E402
from helexa.model.weights.pull import DEFAULT_MODEL, resolve_model  # noqa: E402
from tests.support.models import PagedCache  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# (kind, sequences, context tokens each before the step, new tokens each in the step)
CASES = [("decode", 1, 128, 1), ("decode", 8, 128, 1), ("decode", 16, 128, 1), ("prefill", 1, 0, 500)]

_RSS_PROBE = """
import json, sys, torch
sys.path.insert(0, {src!r})
torch.set_num_threads({threads})
from helexa.model.loader import load_model
from tests.support.models import PagedCache
model = load_model({model!r}, dtype="float32", quantization="auto")
cache = PagedCache(model.config, num_blocks=8, block_size=16)
step = cache.step({{0: [1, 2, 3]}})
model(step.input_ids, step.positions, step.attn, cache.kv_caches, step.logits_indices)
status = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith(("VmHWM", "VmRSS")))
print(json.dumps({{k: int(v.split()[0]) / 1024 for k, v in status.items()}}))
"""


def _use(path: str) -> None:
    os.environ[isa.ENV] = path
    assert native.kernel_path() == path, native.unavailable_reason()


def time_gemm(rounds: int) -> list[str]:
    """Table rows: per layout and row count, each path's median ms, GB/s of weight and speed vs avx2."""
    paths = [p.name for p in isa.candidates("auto")[0]][::-1]
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16384, 4096, generator=g)
    weights = {"int4 g32": quantize_int4(w, group_size=32), "int8": quantize_int8(w)}
    del w
    rows = []
    for name, weight in weights.items():
        tiled = (native.tile_int4 if weight.zeros is not None else native.tile_int8)(*weight.tensors())
        gemm = native.int4_gemm if weight.zeros is not None else native.int8_gemm
        nbytes = sum(t.numel() * t.element_size() for t in tiled)
        for m in (1, 8, 64):
            x = torch.randn(m, 4096, generator=g)
            times: dict[str, list[float]] = {p: [] for p in paths}
            for _ in range(rounds if m < 64 else max(3, rounds // 4)):
                for p in paths:
                    _use(p)
                    start = time.perf_counter()
                    gemm(x, tiled)
                    times[p].append(time.perf_counter() - start)
            base = statistics.median(times[paths[0]])
            for p in paths:
                t = statistics.median(times[p])
                rows.append(f"| {name} | {m} | {p} | {t * 1e3:.2f} | {nbytes / t / 1e9:.1f} | {base / t:.2f}x |")
    os.environ.pop(isa.ENV, None)
    return rows


def step_runner(model: CausalLM, batch: int, context: int, new: int) -> Callable[[], float]:
    """A function that runs one step of `batch` sequences, each with `context` tokens already in its cache and
    `new` tokens in the step (random ids, seeded by `batch`), and returns its seconds. The step re-runs in place:
    the same slots each time. The cache has the dtype the engine gives this model's pool (`kv_cache_dtype`'s
    "auto": float16 under the fused CPU step)."""
    config = model.config
    dtype = kv_cache_dtype("auto", model.dtype, fused_cpu_step=model.native_step is not None)
    cache = PagedCache(config, num_blocks=batch * ((context + new) // 16 + 2) + 1, block_size=16, dtype=dtype)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        if context:
            prompt = torch.randint(0, config.vocab_size, (context,), generator=g).tolist()
            pre = cache.step({i: prompt})
            model(pre.input_ids, pre.positions, pre.attn, cache.kv_caches, pre.logits_indices)
    tokens = torch.randint(0, config.vocab_size, (new,), generator=g).tolist()
    step = cache.step({i: tokens for i in range(batch)})

    def run() -> float:
        start = time.perf_counter()
        model(step.input_ids, step.positions, step.attn, cache.kv_caches, step.logits_indices)
        return time.perf_counter() - start

    return run


def time_paths(model_path: Path, rounds: int) -> list[dict]:
    """Per case and path: the median ms of `rounds` steps, the paths alternating."""
    paths = [p.name for p in isa.candidates("auto")[0]][::-1]  # avx2 first
    model = load_model(model_path, dtype="float32", quantization="auto")
    assert model.native_step is not None, "the model should get the fused step"
    rows = []
    for kind, batch, context, new in CASES:
        run = step_runner(model, batch, context, new)
        times: dict[str, list[float]] = {p: [] for p in paths}
        for p in paths:  # warm up
            _use(p)
            run()
        for _ in range(rounds if new == 1 else max(3, rounds // 4)):
            for p in paths:
                _use(p)
                times[p].append(run())
        base = statistics.median(times[paths[0]])
        for p in paths:
            ms = statistics.median(times[p]) * 1e3
            rows.append({"case": (kind, batch, context, new), "path": p, "ms": ms, "vs_avx2": base * 1e3 / ms})
    os.environ.pop(isa.ENV, None)
    return rows


def rss(src: Path, model_path: Path, threads: int) -> dict[str, float]:
    code = _RSS_PROBE.format(src=str(src), threads=threads, model=str(model_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=src)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="a model directory (default: the default model)")
    parser.add_argument("--baseline", type=Path, default=None, help="a source tree to compare peak RSS with")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--rss-rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_path = args.model or resolve_model(DEFAULT_MODEL)
    head = (
        f"CPU: {cpu_name()}; {args.threads} threads; kernel path chosen: {native.describe_path()} "
        f"(paths this CPU runs: {', '.join(p.name for p in isa.candidates('auto')[0])}); model {model_path.name}"
    )
    print(head, flush=True)
    gemm = time_gemm(args.rounds)
    rows = time_paths(model_path, args.rounds)
    lines = [
        f"# {head}",
        "",
        "| step | sequences | context | new | path | median ms | tok/s | vs avx2 |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        kind, b, c, n = r["case"]
        lines.append(
            f"| {kind} | {b} | {c} | {n} | {r['path']} | {r['ms']:.2f} | {1e3 * b * n / r['ms']:.1f} "
            f"| {r['vs_avx2']:.2f}x |"
        )
    lines += [
        "",
        "| GEMM weight | rows | path | median ms | weight GB/s | vs avx2 |",
        "|---|---:|---|---:|---:|---:|",
        *gemm,
    ]
    trees = [("this tree", ROOT)] + ([("baseline", args.baseline)] if args.baseline else [])
    memory: dict[str, list[dict[str, float]]] = {name: [] for name, _ in trees}
    for _ in range(args.rss_rounds):
        for name, src in trees:
            memory[name].append(rss(src, model_path, args.threads))
    lines += ["", "| tree | peak RSS MiB (VmHWM) | RSS after load + a step MiB |", "|---|---:|---:|"]
    for name, ms in memory.items():
        lines.append(f"| {name} | {min(m['VmHWM'] for m in ms):.0f} | {min(m['VmRSS'] for m in ms):.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu_paths.md").write_text(text)
    _plot(rows, memory)


def _plot(rows: list[dict], memory: dict[str, list[dict[str, float]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    paths = sorted({r["path"] for r in rows}, key=list(isa.PATHS).index)
    cases = list(dict.fromkeys(r["case"] for r in rows))
    for i, p in enumerate(paths):
        tps = [next(1e3 * c[1] * c[3] / r["ms"] for r in rows if r["case"] == c and r["path"] == p) for c in cases]
        a.bar([j + 0.4 * i for j in range(len(cases))], tps, width=0.4, label=p)
    a.set_xticks([j + 0.2 for j in range(len(cases))], [f"{k} {bb}x{c}+{n}" for k, bb, c, n in cases], fontsize=7)
    a.set_ylabel("tokens/s")
    a.set_yscale("log")
    a.legend(fontsize=8)
    a.set_title("fused step per kernel path", fontsize=9)
    names = list(memory)
    b.bar(names, [min(m["VmHWM"] for m in memory[n]) for n in names], label="peak RSS")
    b.bar(names, [min(m["VmRSS"] for m in memory[n]) for n in names], width=0.4, label="RSS after load")
    b.set_ylabel("MiB")
    b.legend(fontsize=8)
    b.set_title("memory: load + one step", fontsize=9)
    fig.tight_layout()
    fig.savefig(RESULTS / "cpu_paths.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
