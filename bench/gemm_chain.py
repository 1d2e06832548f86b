"""A one-row decode step's GEMMs one after another against one GEMM of the same bytes (issue 36): what the
boundaries between a step's GEMMs cost the read rate, apart from everything else a step does.

A one-stream decode step reads each weight once, a GEMM at a time: qkv, o, gate|up and down per layer (89 calls
at the 1B shape with its head). Each call starts its threads' streams afresh (quantizes its activations, forks the
threads, which take their runs of tiles and then each other's last ones, and join). Here the same kernel
(`native.library()`) runs, on random int4 weights with float16 scales in the kernels' layout (groups of 32, as
GGUF Q4_1 gives) on 2 MiB pages (`helexa.model.quant.hugepages`):

- `chain`: the model's layer projections, one call each, in a step's order (`--model`'s shapes, from
  `bench/random_gguf.py`, or the default model's);
- `one GEMM`: a single call over one weight of the same bytes (K the hidden size, its columns rounded up to
  whole tiles of 16).

Both read the same number of bytes from memory (far more than the caches hold), so their time ratio is what the
boundaries cost. Each round samples the read bandwidth (`peers.read_bandwidth`) before and after, runs both in
a shuffled order (`--repeats` each, the median), and the table groups rounds by this VM's bandwidth modes
(`--split` GB/s). The calls are made from Python (ctypes); what a call costs that way is measured too (a call that does
nothing) and the table also gives the chain with that cost taken off: what a step's native loop, which calls the
GEMMs from C, would see of the boundaries.

    python bench/gemm_chain.py --model 1b --rounds 60

Prints the CPU and the kernel path; writes `bench/results/gemm_chain_<model>.md` and `.png`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from peers import read_bandwidth  # noqa: E402
from random_gguf import SHAPES  # noqa: E402

from bench.decode_roofline import bandwidth_modes, plot_fractions  # noqa: E402
from bench.machine import cpu_name  # noqa: E402
from helexa.model.quant import hugepages, native  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GROUP = 32  # values per scale, as GGUF's Q4_1 blocks
CHAIN, ONE = "chain", "one GEMM"


def projections(model: str) -> list[tuple[int, int]]:
    """(N, K) of every projection a one-row step of `model` multiplies, in the step's order (no head)."""
    if model == "135m":  # SmolLM2-135M: 576 hidden, 30 layers, 1536 FFN, 9 query / 3 KV heads of 64
        hidden, layers, ffn, heads, kv_heads = 576, 30, 1536, 9, 3
    else:
        s = SHAPES[model]
        hidden, layers, ffn, heads, kv_heads = s.hidden, s.layers, s.ffn, s.heads, s.kv_heads
    kv = hidden // heads * kv_heads
    layer = [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * ffn, hidden), (hidden, ffn)]
    return layer * layers


class Int4Weight:
    """Random int4 weight bytes, float16 scales and zero terms in the kernels' tiled layout, on 2 MiB pages
    (`hugepages.empty`)."""

    def __init__(self, n: int, k: int, rng: np.random.Generator) -> None:
        self.n, self.k = n, k
        self.q = hugepages.empty((n * k // 2,), torch.uint8)
        self.q.numpy()[:] = rng.integers(0, 256, n * k // 2, dtype=np.uint8)
        self.scales, self.zeros = (hugepages.empty((n * k // GROUP,), torch.float16) for _ in range(2))
        for t in (self.scales, self.zeros):
            t.numpy()[:] = rng.uniform(-0.05, 0.05, t.numel()).astype(np.float16)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 2 * 2 * self.scales.numel()

    def gemm(self, lib: Any, x: torch.Tensor, y: torch.Tensor) -> None:
        lib.helexa_int4_gemm(x.data_ptr(), 1, self.k, self.q.data_ptr(), self.scales.data_ptr(),
                             self.zeros.data_ptr(), 1, self.n, GROUP, y.data_ptr())  # fmt: skip


def call_seconds(lib: Any) -> float:
    """What a call into the library costs from Python (ctypes) alone: one that does nothing (the lookup of no
    rows, `helexa_dequantize_rows` with R = 0, 11 arguments as a GEMM's 10)."""
    w = Int4Weight(16, 2048, np.random.default_rng(1))
    ids, x = torch.zeros(1, dtype=torch.int64), torch.empty(2048)
    args = (w.q.data_ptr(), None, w.scales.data_ptr(), w.zeros.data_ptr(), 1, 16, 2048, GROUP, ids.data_ptr(), 0,
            x.data_ptr())  # fmt: skip
    times = []
    for _ in range(5000):
        start = time.perf_counter()
        lib.helexa_dequantize_rows(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(args: argparse.Namespace) -> tuple[list[dict[str, Any]], int, int, str]:
    """(each round's {"bandwidth": [before, after], contender: seconds}, bytes read, calls in the chain, head)."""
    torch.set_num_threads(args.threads)
    lib = native.library()  # set to torch's thread count, just set
    shapes = projections(args.model)
    rng = np.random.default_rng(0)
    print(f"making {len(shapes)} weights of {args.model}'s projections and one of the same bytes ...", flush=True)
    with hugepages.packing():  # as a model's load: projections under 2 MiB share advised regions too
        chain = [Int4Weight(n, k, rng) for n, k in shapes]
    # One weight of every projection's columns over the hidden size: the same bytes as the chain's, up to the
    # down projections' wider K (their bytes go to more columns of K = hidden).
    nbytes = sum(w.nbytes for w in chain)
    k_one = shapes[0][1]
    one = Int4Weight(-(-nbytes // (k_one * 5 // 8)) // 16 * 16, k_one, rng)
    xs = {k: torch.randn(k) for k in {k for _, k in shapes}}
    y = torch.empty(max(one.n, *(n for n, _ in shapes)))

    def run_chain() -> float:
        start = time.perf_counter()
        for w in chain:
            w.gemm(lib, xs[w.k], y)
        return time.perf_counter() - start

    def run_one() -> float:
        start = time.perf_counter()
        one.gemm(lib, xs[k_one], y)
        return time.perf_counter() - start

    contenders = {CHAIN: run_chain, ONE: run_one}
    per_call = call_seconds(lib)
    head = (
        f"CPU: {cpu_name()}; {args.threads} threads; kernel path {native.kernel_path()}; model {args.model}'s "
        f"{len(shapes)} projections ({nbytes / 2**20:.0f} MiB of int4 weights and float16 scales) against one "
        f"GEMM of {one.nbytes / 2**20:.0f} MiB; a call's own cost from Python (ctypes): "
        f"{per_call * 1e6:.1f} us ({per_call * len(shapes) * 1e3:.2f} ms a chain)"
    )
    print(head, flush=True)
    for run in contenders.values():
        run()
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        before = read_bandwidth(args.threads, repeats=2)
        result: dict[str, Any] = {}
        for name in random.sample(list(contenders), len(contenders)):
            result[name] = statistics.median(contenders[name]() for _ in range(args.repeats))
        result["bandwidth"] = [before, read_bandwidth(args.threads, repeats=2)]
        result["bytes"] = {CHAIN: nbytes, ONE: one.nbytes}
        result["python"] = per_call * len(shapes)
        rounds.append(result)
        mean = statistics.fmean(result["bandwidth"])
        line = ", ".join(
            f"{n} {result[n] * 1e3:.2f} ms ({result['bytes'][n] / result[n] / mean:.0%})" for n in contenders
        )
        print(f"round {r + 1}/{args.rounds}: {mean / 1e9:.1f} GB/s; {line}", flush=True)
    return rounds, nbytes, len(shapes), head


def fraction(r: dict[str, Any], name: str) -> float:
    """The contender's bytes over its time, as a fraction of the bandwidth sampled around the round."""
    return r["bytes"][name] / r[name] / statistics.fmean(r["bandwidth"])


def report(rounds: list[dict[str, Any]], calls: int, head: str, split: float) -> str:
    lines = [
        f"# {head}",
        "",
        f"Rounds grouped by the read bandwidth sampled before and after them (split at {split:.0f} GB/s; mixed: the "
        "mode changed between the two samples); medians over the "
        "mode's rounds. Of roofline: bytes / time / the round's bandwidth. Speed-up: the chain's time per byte over "
        "the one GEMM's, both within the same round.",
        "",
        "| bandwidth mode | rounds | GB/s | chain, of roofline | one GEMM, of roofline | one GEMM's speed-up "
        "| the chain less its calls' Python, of roofline | its extra time per call (us) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, group in bandwidth_modes(rounds, split):
        speed = [(r[CHAIN] / r["bytes"][CHAIN]) / (r[ONE] / r["bytes"][ONE]) for r in group]
        bare = [r["bytes"][CHAIN] / (r[CHAIN] - r["python"]) / statistics.fmean(r["bandwidth"]) for r in group]
        extra = [(r[CHAIN] - r["python"] - r[ONE] * r["bytes"][CHAIN] / r["bytes"][ONE]) / calls * 1e6 for r in group]
        lines.append(
            f"| {mode} | {len(group)} | {statistics.median(statistics.fmean(r['bandwidth']) for r in group) / 1e9:.1f} "
            f"| {100 * statistics.median(fraction(r, CHAIN) for r in group):.1f}% "
            f"| {100 * statistics.median(fraction(r, ONE) for r in group):.1f}% | {statistics.median(speed):.3f}x "
            f"| {100 * statistics.median(bare):.1f}% | {statistics.median(extra):.1f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rounds: list[dict[str, Any]], head: str, path: Path) -> None:
    bws = [statistics.fmean(r["bandwidth"]) / 1e9 for r in rounds]
    points = {name: [(bw, 100 * fraction(r, name)) for r, bw in zip(rounds, bws)] for name in (CHAIN, ONE)}
    plot_fractions(points, "% of the read roofline", "issue 36's target for a step (80%)", head, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="1b", choices=("135m", *SHAPES))
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=5, help="runs of each contender per round (the median)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--split", type=float, default=45.0, help="GB/s between this VM's two bandwidth modes")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rounds, _, calls, head = measure(args)
    text = report(rounds, calls, head, args.split)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"gemm_chain_{args.model}.md").write_text(text)
    plot(rounds, head, args.out / f"gemm_chain_{args.model}.png")


if __name__ == "__main__":
    main()
