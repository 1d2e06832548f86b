"""One decode step of the fused CPU step against the memory's read bandwidth at that moment: this tree's kernels
against another commit's, in one process, on the same weights and cache (issue 36).

A one-stream decode step reads every weight once, so its roofline is the read bandwidth over the weights'
bytes (the GGUF's tensors, as `bench/peers.py` counts them). This VM's bandwidth has two modes (about 34 and
60 GB/s with 2 threads) that switch within minutes, so a fraction against a sample taken at another moment
says little. Each round here samples the bandwidth (`peers.read_bandwidth`: a sum over 1 GiB on 2 MiB pages,
best of 3), times `--steps` decode steps with each kernel library in a shuffled order, and samples it again;
each library's median step is held against the mean of the two samples. Rounds are grouped by mode (`--split`
GB/s; a round whose two samples fall in different modes is reported apart, as `mixed`) and the table gives,
per mode and library, the median step time and fraction of the roofline, and the median over rounds of the
step-time ratio between the libraries (both measured within the same seconds).

The libraries are this tree's (`native.library()`) and, with `--baseline REV`, that commit's C sources built
with this tree's flags on the kernel path this process chose (`native.load_path(path, csrc=...)`): the
model, its weights in the kernels' layout and its cache are this tree's, so only the kernels differ.

Models: `135m` (the default model's GGUF), `1b` and `8b` (`bench/random_gguf.py`'s random-weight files of
real shapes, made once; that needs the llama.cpp peer, `bash bench/setup_llama_cpp.sh`).

    python bench/decode_roofline.py --model 1b --baseline HEAD~2
    python bench/decode_roofline.py --model 1b --rounds 10 --steps 4     # this tree alone, a short run

Prints the CPU and the kernel path; writes `bench/results/decode_roofline_<model>.md` and `.png`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from peers import model_gguf, read_bandwidth, weight_bytes  # noqa: E402

from bench.cpu_paths import step_runner  # noqa: E402
from bench.machine import cpu_name  # noqa: E402
from helexa.model.loader import load_model  # noqa: E402
from helexa.model.quant import isa, native  # noqa: E402
from helexa.model.weights.pull import convert_gguf_file  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
THIS = "this tree"


def baseline_library(rev: str, path: str) -> Any:
    """Commit `rev`'s kernel sources (its `helexa/model/quant/csrc`) built with this tree's flags for `path` and
    loaded; SystemExit with the reason when that fails."""
    listing = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:helexa/model/quant/csrc"],
                             capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="helexa-csrc-") as tmp:  # the library is built under $HELEXA_HOME
        for name in listing:
            blob = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:helexa/model/quant/csrc/{name}"],
                                  capture_output=True, check=True).stdout  # fmt: skip
            (Path(tmp) / name).write_bytes(blob)
        lib, why = native.load_path(isa.PATHS[path], csrc=Path(tmp))
    if lib is None:
        raise SystemExit(f"the kernels of {rev} do not load: {why}")
    return lib


def kernel_libraries(baseline: str | None, threads: int) -> dict[str, Any]:
    """{THIS: this tree's kernel library} and, with `baseline` (a commit), {"baseline <commit>": that commit's, built
    for this process's kernel path}; each set to run on `threads` threads."""
    libraries = {THIS: native.library()}
    if baseline:
        libraries[f"baseline {baseline}"] = baseline_library(baseline, native.kernel_path())
    for lib in libraries.values():
        lib.helexa_set_threads(threads)
    return libraries


def decode_step(model_dir: Path, context: int) -> Callable[[], float]:
    """A function that runs one decode step of one sequence with `context` tokens before it (`step_runner`: re-run
    in place, the same slot each time) and returns its seconds."""
    model = load_model(model_dir, dtype="float32", quantization="auto")
    if model.native_step is None:
        raise SystemExit("this model does not run on the fused CPU step here")
    return step_runner(model, 1, context, 1)


def measure(args: argparse.Namespace) -> tuple[list[dict[str, Any]], int, str]:
    """(each round's {"bandwidth": [before, after], library name: median step seconds}, weight bytes, head)."""
    torch.set_num_threads(args.threads)
    gguf = model_gguf(args.model, args.threads)
    nbytes, _ = weight_bytes(gguf)
    path = native.kernel_path()
    libraries = kernel_libraries(args.baseline, args.threads)
    head = (
        f"CPU: {cpu_name()}; {args.threads} threads; kernel path {path}; model {args.model} ({gguf.name}, "
        f"{nbytes / 2**20:.0f} MiB of weights); one sequence at {args.context} tokens of context"
    )
    print(head, flush=True)
    run = decode_step(convert_gguf_file(gguf, progress=False), args.context)
    own = native.library
    rounds: list[dict[str, Any]] = []
    try:
        for lib in libraries.values():  # warm up: each library's first step builds nothing in the timing
            native.library = lambda lib=lib: lib  # type: ignore[method-assign]
            run()
        for r in range(args.rounds):
            before = read_bandwidth(args.threads, repeats=3)
            result: dict[str, Any] = {}
            order = list(libraries)
            random.shuffle(order)
            for name in order:
                native.library = lambda lib=libraries[name]: lib  # type: ignore[method-assign]
                result[name] = statistics.median(run() for _ in range(args.steps))
            result["bandwidth"] = [before, read_bandwidth(args.threads, repeats=3)]
            rounds.append(result)
            mean = statistics.fmean(result["bandwidth"])
            line = ", ".join(f"{n} {result[n] * 1e3:.2f} ms ({nbytes / result[n] / mean:.0%})" for n in libraries)
            print(f"round {r + 1}/{args.rounds}: {mean / 1e9:.1f} GB/s; {line}", flush=True)
    finally:
        native.library = own  # type: ignore[method-assign]
    return rounds, nbytes, head


def _names(rounds: list[dict[str, Any]]) -> list[str]:
    """The libraries measured: this tree's first."""
    return sorted((k for k in rounds[0] if k != "bandwidth"), key=lambda k: k != THIS)


def bandwidth_modes(rounds: list[dict[str, Any]], split: float) -> list[tuple[str, list[dict[str, Any]]]]:
    """The rounds in this VM's two bandwidth modes: ("slow", those whose two samples are both under `split`
    GB/s), ("fast", both at or over it), then ("mixed", those whose samples straddle it: the mode changed while
    the round ran, so neither mode's fraction applies to them); a group without rounds is left out (also
    `bench/gemm_chain.py`'s)."""
    groups: dict[str, list[dict[str, Any]]] = {"slow": [], "fast": [], "mixed": []}
    for r in rounds:
        slow = [bw < split * 1e9 for bw in r["bandwidth"]]
        groups["slow" if all(slow) else "fast" if not any(slow) else "mixed"].append(r)
    return [(mode, group) for mode, group in groups.items() if group]


def report(rounds: list[dict[str, Any]], nbytes: int, head: str, split: float) -> str:
    names = _names(rounds)
    lines = [
        f"# {head}",
        "",
        f"Rounds grouped by the read bandwidth sampled before and after them (split at {split:.0f} GB/s; mixed: "
        "the mode changed between the two samples). Step: the median of "
        "the round's steps, then over the mode's rounds; of roofline: weight bytes / step / the round's bandwidth.",
        "",
        "| bandwidth mode | rounds | GB/s (median) | library | step ms | of roofline | GB/s of weights |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    ratios: list[str] = []
    for mode, group in bandwidth_modes(rounds, split):
        bw = statistics.median(statistics.fmean(r["bandwidth"]) for r in group)
        for name in names:
            step = statistics.median(r[name] for r in group)
            frac = statistics.median(nbytes / r[name] / statistics.fmean(r["bandwidth"]) for r in group)
            lines.append(
                f"| {mode} | {len(group)} | {bw / 1e9:.1f} | {name} | {step * 1e3:.2f} | {100 * frac:.1f}% "
                f"| {nbytes / step / 1e9:.1f} |"
            )
        if len(names) == 2:
            each = [r[names[1]] / r[THIS] for r in group]
            ratios.append(
                f"- {mode}: median {statistics.median(each):.3f}x (lowest {min(each):.3f}, highest {max(each):.3f}, "
                f"{len(each)} rounds)"
            )
    if ratios:
        lines += ["", f"Speed-up: {names[1]}'s step time / this tree's, both timed within the same round:", "", *ratios]
    return "\n".join(lines) + "\n"


def plot_fractions(
    points: dict[str, list[tuple[float, float]]], ylabel: str, target: str, head: str, path: Path
) -> None:
    """Each series' (read bandwidth in GB/s, % of the roofline) points against issue 36's 80% line (`target` its
    legend), titled `head`, written to `path` as a PNG (also `bench/gemm_chain.py`'s)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, xy in points.items():
        ax.scatter([x for x, _ in xy], [y for _, y in xy], label=name, s=14)
    ax.axhline(80, color="grey", ls="--", lw=1, label=target)
    ax.set_xlabel("read bandwidth around the round (GB/s)")
    ax.set_ylabel(ylabel)
    ax.set_title(head, fontsize=7, wrap=True)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot(rounds: list[dict[str, Any]], nbytes: int, head: str, path: Path) -> None:
    bws = [statistics.fmean(r["bandwidth"]) / 1e9 for r in rounds]
    points = {
        name: [(bw, 100 * nbytes / r[name] / (bw * 1e9)) for r, bw in zip(rounds, bws)] for name in _names(rounds)
    }
    plot_fractions(points, "decode step, % of the read roofline", "issue 36's target (80%)", head, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="1b", choices=("135m", "1b", "8b"))
    parser.add_argument("--baseline", default=None, help="a commit whose kernels to measure in the same rounds")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--steps", type=int, default=8, help="decode steps per library per round")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--split", type=float, default=45.0, help="GB/s between this VM's two bandwidth modes")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rounds, nbytes, head = measure(args)
    text = report(rounds, nbytes, head, args.split)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"decode_roofline_{args.model}.md").write_text(text)
    plot(rounds, nbytes, head, args.out / f"decode_roofline_{args.model}.png")


if __name__ == "__main__":
    main()
