"""How fast the native quantized GEMM streams its weights from 2 MiB pages against 4 KiB pages (issue 36).

The same tiled weights, once in `helexa.model.quant.hugepages` memory and once copied to `torch.empty`'s
4 KiB pages, each GEMM'd at 1, 2, 4 and 8 rows, alternating, for `--seconds`:
- `int4`: a 1B model's MLP shape, int4 11264 x 2048, six of them, 66 MiB with their scales;
- `int8`: an int8 head of 49152 x 2048, 107 MiB;
- `small`: the default model's (SmolLM2-135M) decoder projections, 30 layers of int4 q|k|v (960 x 576),
  o (576 x 576), gate|up (3072 x 576) and down (576 x 1536), 0.3-1.1 MB each with their scales (66 MB
  in all), GEMM'd in a step's order.

All are tiled inside `hugepages.packing()`, as the loader tiles them (weights and scales under 2 MiB
packed into shared regions).

Each GEMM is the library's call with its arguments bound once, as the fused step makes it. Every round
also sums a 1 GiB buffer on each page size: this VM's bandwidth has two modes that switch within minutes,
so rounds are grouped by the mode their own sample shows (`--split` GB/s on 4 KiB pages) and each group's
medians are reported.

    python bench/weight_pages.py [--seconds 300] [--threads 2]

Prints the CPU and the kernel path; writes `bench/results/weight_pages.md` and `.png`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.machine import cpu_name  # noqa: E402
from helexa.model.quant import hugepages, native  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ROWS = (1, 2, 4, 8)
KINDS = ("int4", "int8", "small")


def _on_small_pages(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype).copy_(t)


@hugepages.packing()  # as the loader tiles: scales and weights under 2 MiB packed into shared regions
def _weights(g: torch.Generator) -> dict[str, list[tuple[torch.Tensor, ...]]]:
    int4 = [
        native.tile_int4(
            torch.randint(0, 256, (11264, 1024), dtype=torch.uint8, generator=g),
            torch.rand(11264, 64, generator=g).half().float(),
            torch.rand(11264, 64, generator=g).half().float(),
        )
        for _ in range(6)
    ]
    int8 = [
        native.tile_int8(
            torch.randint(-128, 128, (49152, 2048), dtype=torch.int8, generator=g),
            torch.rand(49152, 64, generator=g).half().float(),
        )
    ]
    return {"int4": int4, "int8": int8, "small": _small(g)}


def _small(g: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30
    return [
        native.tile_int4(
            torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g),
            torch.rand(n, k // 32, generator=g).half().float(),
            torch.rand(n, k // 32, generator=g).half().float(),
        )
        for n, k in shapes
    ]


def _call(w: tuple[torch.Tensor, ...], x: torch.Tensor) -> Callable[[], None]:
    """The library's GEMM of `x` by the tiled weight `w` with its arguments bound once (as the fused step
    calls it, without `native.int4_gemm`'s checks and allocation: a ~120-weight pass would time those)."""
    n, k = native._dims(w)
    y = torch.empty(x.shape[0], n)
    fn = native.library().helexa_int4_gemm if len(w) == 3 else native.library().helexa_int8_gemm
    args = (x.data_ptr(), x.shape[0], k, *(t.data_ptr() for t in w), w[1].dtype == torch.float16, n,
            k // w[1].shape[1], y.data_ptr())  # fmt: skip
    checked = native.int4_gemm if len(w) == 3 else native.int8_gemm
    if fn(*args) != 0 or not torch.equal(y, checked(x, w)):  # the bound call is the checked one's, bit for bit
        raise SystemExit(f"the bound GEMM call ({n} x {k}) disagrees with native's")

    def call(_keep: tuple = (w, x, y)) -> None:  # `_keep`: the memory behind `args`' pointers
        fn(*args)

    return call


def _gbps(weights: list[tuple[torch.Tensor, ...]], xs: dict[int, torch.Tensor]) -> float:
    """GB/s of weight (bytes, scales and zero terms) one pass over `weights` reads, each weight GEMM'd with
    the activations `xs[K]` of its K; best of 2."""
    nbytes = sum(t.numel() * t.element_size() for w in weights for t in w)
    calls = [_call(w, xs[native._dims(w)[1]]) for w in weights]
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        for call in calls:
            call()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _sum_gbps(buf: torch.Tensor) -> float:
    t0 = time.perf_counter()
    float(buf.sum())
    return buf.numel() * 4 / (time.perf_counter() - t0) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--split", type=float, default=42.0, help="GB/s (4 KiB sum) between the two modes")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not native.available():
        print(f"helexa's CPU kernel is unavailable: {native.unavailable_reason()}")
        return 1
    if not hugepages.enabled():
        print("no transparent huge pages here (THP mode never, or HELEXA_HUGEPAGES=off): nothing to compare")
        return 1
    torch.set_num_threads(args.threads)
    huge = _weights(torch.Generator().manual_seed(0))
    small = {k: [tuple(_on_small_pages(t) for t in w) for w in ws] for k, ws in huge.items()}
    sums = {"2M": hugepages.empty((1 << 28,), torch.float32).fill_(1.0), "4K": torch.ones(1 << 28)}
    xs = {
        m: {k: torch.randn(m, k, generator=torch.Generator().manual_seed(m)) for k in (576, 1536, 2048)} for m in ROWS
    }
    print(f"CPU {cpu_name()}; kernel path {native.kernel_path()}; {args.threads} threads", flush=True)
    rounds: list[dict[str, float]] = []
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        r = {"sum 4K": _sum_gbps(sums["4K"]), "sum 2M": _sum_gbps(sums["2M"])}
        for kind in KINDS:
            for m in ROWS:
                r[f"{kind} {m} 4K"] = _gbps(small[kind], xs[m])
                r[f"{kind} {m} 2M"] = _gbps(huge[kind], xs[m])
        rounds.append(r)
        if len(rounds) % 20 == 0:
            print(f"  {len(rounds)} rounds; last: sum 4K {r['sum 4K']:.1f}, int4 1 row 2M {r['int4 1 2M']:.1f} GB/s")
    groups = {
        "slow": [r for r in rounds if r["sum 4K"] < args.split],
        "fast": [r for r in rounds if r["sum 4K"] >= args.split],
    }
    lines = [
        f"# Weight streaming from 2 MiB and 4 KiB pages — {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        f"CPU: {cpu_name()}; kernel path {native.kernel_path()}; {args.threads} threads; torch {torch.__version__}; "
        f"{len(rounds)} rounds in {args.seconds:.0f} s, grouped by each round's own 4 KiB-page sum "
        f"(under / over {args.split:.0f} GB/s). GB/s of weight read, medians.",
        "",
    ]
    for name, sel in groups.items():
        if not sel:
            continue
        med = {k: statistics.median(r[k] for r in sel) for k in sel[0]}
        lines += [
            f"## {name} mode: {len(sel)} rounds; sum {med['sum 4K']:.1f} GB/s on 4 KiB pages, "
            f"{med['sum 2M']:.1f} on 2 MiB",
            "",
            "| weight | rows | 4 KiB pages | 2 MiB pages | ratio |",
            "|---|---|---|---|---|",
        ]
        for kind in KINDS:
            for m in ROWS:
                a, b = med[f"{kind} {m} 4K"], med[f"{kind} {m} 2M"]
                lines.append(f"| {kind} | {m} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "weight_pages.md").write_text(text + "\n")
    _plot(groups, args.out / "weight_pages.png")
    return 0


def _plot(groups: dict[str, list[dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = {k: v for k, v in groups.items() if v}
    fig, axes = plt.subplots(1, len(shown), figsize=(6 * len(shown), 4), squeeze=False)
    for ax, (name, sel) in zip(axes[0], shown.items()):
        for kind, style in zip(KINDS, ("-", "--", "-.")):
            for page, color in (("4K", "tab:grey"), ("2M", "tab:blue")):
                ys = [statistics.median(r[f"{kind} {m} {page}"] for r in sel) for m in ROWS]
                ax.plot(ROWS, ys, style, color=color, marker="o", label=f"{kind}, {page} pages")
        ax.axhline(statistics.median(r["sum 2M"] for r in sel), color="tab:blue", lw=0.8, ls=":", label="sum, 2M")
        ax.axhline(statistics.median(r["sum 4K"] for r in sel), color="tab:grey", lw=0.8, ls=":", label="sum, 4K")
        ax.set(title=f"{name} bandwidth mode ({len(sel)} rounds)", xlabel="rows", ylabel="GB/s of weight read")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
