"""The quantized GEMM where the arithmetic, not the memory, bounds it: multiply-adds a second by row count, this
tree's kernels against another commit's, on the same weights in one process (issue 36).

A batch of decoding streams, a speculative draft's rows and a prefill's rows multiply each weight by several
rows at once, so past a few rows the int8 dot products, not the weight bytes, set a GEMM's time. Here a model's
layer projections (`--model`'s shapes: qkv, o, gate|up, down, one call each) as int4 with float16 scales in groups
of 32 (GGUF Q4_1's layout), and its tied output head as int8 with float16 scales in groups of 32 (Q8_0's), take
`--rows` rows of random activations through `helexa_int4_gemm` / `helexa_int8_gemm`. The weights are random
bytes in the kernels' tiled layout; the layer's int4 weights fit the caches of a server core at 135M and not at
1B, the head never does (at one row both read memory; at 16 rows and more each weight byte meets 16 or more
multiply-adds).

The libraries are this tree's (`native.library()`) and, with `--baseline REV`, that commit's C sources built with
this tree's flags on the kernel path this process chose (`decode_roofline.kernel_libraries`). Each round times
every (kind, rows) with each library in a shuffled order, `--repeats` calls each (the median), and checks that
both libraries wrote the same bits (the kernels promise one result per row whatever else they run; a change of
arithmetic fails the run). The table gives, per kind and row count, each library's median GMAC/s over rounds and
the median over rounds of the time ratio (baseline / this tree: > 1 is faster).

    python bench/gemm_rows.py --model 1b --baseline HEAD~1
    python bench/gemm_rows.py --model 135m --rounds 3             # this tree alone

Prints the CPU and the kernel path; writes `bench/results/gemm_rows_<model>.md` and `.png`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from gemm_chain import projections  # noqa: E402
from random_gguf import SHAPES  # noqa: E402

from bench.decode_roofline import THIS, kernel_libraries  # noqa: E402
from bench.machine import cpu_name  # noqa: E402
from helexa.model.quant import native  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GROUP = 32  # values per scale, as GGUF's Q4_1 and Q8_0 blocks
VOCAB = 49_152  # the default model's vocabulary, which the random-weight shapes share
KINDS = ("int4 layer", "int8 head")


class Weight:
    """A random (N, K) weight in the kernels' tiled layout: int4 bytes with float16 scales and zero terms, or int8
    with float16 scales, in groups of 32."""

    def __init__(self, n: int, k: int, bits: int, rng: np.random.Generator) -> None:
        self.n, self.k, self.bits = n, k, bits
        self.q = torch.from_numpy(rng.integers(0, 256, n * k * bits // 8, dtype=np.uint8))
        if bits == 8:
            self.q = self.q.view(torch.int8)
        self.scales = torch.from_numpy(rng.uniform(-0.05, 0.05, n * k // GROUP).astype(np.float16))
        self.zeros = torch.from_numpy(rng.uniform(-0.05, 0.05, n * k // GROUP).astype(np.float16))

    def gemm(self, lib: Any, x: torch.Tensor, y: torch.Tensor) -> None:
        """y (M, N) = x (M, K) @ W.T through `lib`."""
        if self.bits == 4:
            lib.helexa_int4_gemm(x.data_ptr(), x.shape[0], self.k, self.q.data_ptr(), self.scales.data_ptr(),
                                 self.zeros.data_ptr(), 1, self.n, GROUP, y.data_ptr())  # fmt: skip
        else:
            lib.helexa_int8_gemm(x.data_ptr(), x.shape[0], self.k, self.q.data_ptr(), self.scales.data_ptr(), 1,
                                 self.n, GROUP, y.data_ptr())  # fmt: skip


def weights(model: str, rng: np.random.Generator) -> dict[str, list[Weight]]:
    """Each kind's weights: one layer's four int4 projections, and the int8 head."""
    hidden = 576 if model == "135m" else SHAPES[model].hidden
    return {
        KINDS[0]: [Weight(n, k, 4, rng) for n, k in projections(model)[:4]],
        KINDS[1]: [Weight(VOCAB, hidden, 8, rng)],
    }


def macs(ws: list[Weight], rows: int) -> int:
    return rows * sum(w.n * w.k for w in ws)


def gmacs(per_row: dict[str, int], key: str, seconds: float) -> float:
    """GMAC/s of a round's entry `key` ("kind|rows") done in `seconds`."""
    kind, rows = key.split("|")
    return per_row[kind] * int(rows) / seconds / 1e9


def measure(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, int], str]:
    """(each round's {(kind, rows): {library: seconds}}, each kind's multiply-adds a row, head)."""
    torch.set_num_threads(args.threads)
    path = native.kernel_path()
    libraries = kernel_libraries(args.baseline, args.threads)
    rng = np.random.default_rng(0)
    kinds = weights(args.model, rng)
    head = f"CPU: {cpu_name()}; {args.threads} threads; kernel path {path}; model shapes {args.model}"
    print(head, flush=True)
    per_row = {kind: macs(ws, 1) for kind, ws in kinds.items()}
    xs = {(r, k): torch.from_numpy(rng.standard_normal((r, k), dtype=np.float32)) for r in args.rows
          for k in {w.k for ws in kinds.values() for w in ws}}  # fmt: skip
    rounds: list[dict[str, Any]] = []
    for i in range(args.rounds):
        result: dict[str, Any] = {}
        for kind, ws in kinds.items():
            for rows in args.rows:
                times: dict[str, float] = {}
                outs: dict[str, list[torch.Tensor]] = {}
                order = list(libraries)
                random.shuffle(order)
                for name in order:
                    lib = libraries[name]
                    ys = [torch.full((rows, w.n), float("nan")) for w in ws]
                    for w, y in zip(ws, ys, strict=True):  # first call: warm, and the bits to compare
                        w.gemm(lib, xs[rows, w.k], y)
                    outs[name] = ys
                    samples = []
                    for _ in range(args.repeats):
                        start = time.perf_counter()
                        for w, y in zip(ws, ys, strict=True):
                            w.gemm(lib, xs[rows, w.k], y)
                        samples.append(time.perf_counter() - start)
                    times[name] = statistics.median(samples)
                ours = outs[THIS]
                for name, ys in outs.items():
                    if not all(torch.equal(a, b) for a, b in zip(ys, ours, strict=True)):
                        raise SystemExit(f"{name} and {THIS} differ at {kind}, {rows} rows: not the same arithmetic")
                result[f"{kind}|{rows}"] = times
        rounds.append(result)
        line = ", ".join(f"{k.replace('|', ' x')}: {gmacs(per_row, k, t[THIS]):.0f}" for k, t in result.items())
        print(f"round {i + 1}/{args.rounds} (GMAC/s, {THIS}): {line}", flush=True)
    return rounds, per_row, head


def _names(rounds: list[dict[str, Any]]) -> list[str]:
    """The libraries measured: this tree's first."""
    first = next(iter(rounds[0].values()))
    return sorted(first, key=lambda k: k != THIS)


def report(rounds: list[dict[str, Any]], per_row: dict[str, int], head: str) -> str:
    """The table: per kind and row count, each library's median GMAC/s and the median per-round time ratio."""
    names = _names(rounds)
    base = [n for n in names if n != THIS]
    lines = [
        f"# The quantized GEMM by row count — {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        head + f"; {len(rounds)} rounds, libraries in a shuffled order each; the same bits from every library.",
        "",
        "| weights | rows | " + " | ".join([*(f"{n}, GMAC/s" for n in names), *(f"{b} / {THIS}" for b in base)]) + " |",
        "|---|---:|" + "---:|" * (len(names) + len(base)),
    ]
    for key in rounds[0]:
        kind, rows = key.split("|")
        cells = [f"{gmacs(per_row, key, statistics.median(r[key][n] for r in rounds)):.1f}" for n in names]
        cells += [f"{statistics.median(r[key][b] / r[key][THIS] for r in rounds):.3f}x" for b in base]
        lines.append(f"| {kind} | {rows} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rounds: list[dict[str, Any]], per_row: dict[str, int], head: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for kind in per_row:
        keys = [k for k in rounds[0] if k.startswith(kind + "|")]
        rows = [int(k.split("|")[1]) for k in keys]
        for n in _names(rounds):
            rate = [gmacs(per_row, k, statistics.median(r[k][n] for r in rounds)) for k in keys]
            ax.plot(rows, rate, marker="o", linestyle="-" if n == THIS else "--", label=f"{kind}, {n}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows")
    ax.set_ylabel("GMAC/s (median over rounds)")
    ax.set_title(head, fontsize=7, wrap=True)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="135m", choices=("135m", "1b", "8b"))
    parser.add_argument("--baseline", default=None, help="a commit whose kernels to measure in the same rounds")
    parser.add_argument("--rows", default="1,4,16,64,256", help="row counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per library, kind and row count a round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.rows = [int(r) for r in args.rows.split(",")]
    rounds, per_row, head = measure(args)
    text = report(rounds, per_row, head)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"gemm_rows_{args.model}"
    stem.with_suffix(".md").write_text(text)
    plot(rounds, per_row, head, stem.with_suffix(".png"))
    print(f"wrote {stem.with_suffix('.md')} and {stem.with_suffix('.png')}")


if __name__ == "__main__":
    main()
