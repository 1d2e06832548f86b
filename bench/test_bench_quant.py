"""Quantized matmul microbenchmarks: helexa's quantized execution against a dequantise-then-matmul
baseline and the dense float32 matmul, measured in the same run.

`make bench` runs them with pytest-benchmark and writes `bench/out/quant.md` and `bench/out/quant.png`.
CPU: `helexa.model.quant.cpu.CpuQuantMatmul` with helexa's own kernel ("quantized": int8 activation
blocks, integer dot products; the dense path from `DENSE_ROWS` rows) and with torch's packed kernels
("torch_packed": bfloat16 activations) on SmolLM2-135M's shapes (the default model) at 1, 8, 16 and
128 rows. CUDA: the Triton W4A16/W8A16 kernels on 4096x4096 in bfloat16.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helexa.kernels.quant_matmul import int4_matmul, int8_matmul
from helexa.model.quant import QuantizedWeight, quantize_int4, quantize_int8
from helexa.model.quant.cpu import CpuQuantMatmul

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
OUT_DIR = Path(__file__).parent / "out"
# (N, K): q|k|v, gate|up, down, the tied head
SHAPES = [(4096, 4096)] if CUDA else [(960, 576), (3072, 576), (576, 1536), (49152, 576)]
ROWS = [1, 16, 256] if CUDA else [1, 8, 16, 128]
LAYOUTS = ["int4", "int8"]
IMPLS = ["quantized", "dequantize_then_matmul", "dense_float"] + ([] if CUDA else ["torch_packed"])
_RESULTS: list[dict] = []


def _weight(n: int, k: int, layout: str) -> QuantizedWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
    q = quantize_int4(w, group_size=32) if layout == "int4" else quantize_int8(w)
    return q.to("cuda") if CUDA else q


def _fn(impl: str, weight: QuantizedWeight, x: torch.Tensor):
    if impl == "dense_float":
        dense = weight.dequantize(x.dtype)
        return lambda: F.linear(x, dense)
    if impl == "dequantize_then_matmul":
        return lambda: F.linear(x, weight.dequantize(x.dtype))
    if CUDA:
        if weight.zeros is None:
            return lambda: int8_matmul(x, weight.qweight, weight.scales)
        return lambda: int4_matmul(x, weight.qweight, weight.scales, weight.zeros)
    run = CpuQuantMatmul(weight, kernel="torch" if impl == "torch_packed" else None)
    return lambda: run(x)


@pytest.fixture(scope="module", autouse=True)
def _write_report():
    yield
    if not _RESULTS:
        return
    OUT_DIR.mkdir(exist_ok=True)
    device = torch.cuda.get_device_name() if CUDA else "CPU"
    lines = [
        f"# quantized matmul ({device}, {torch.get_num_threads()} threads)",
        "",
        "| layout | N x K | rows | impl | median µs | vs dequantise-then-matmul | vs dense float |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    by_key = {(r["layout"], r["shape"], r["rows"], r["impl"]): r["us"] for r in _RESULTS}
    for r in _RESULTS:
        base = by_key.get((r["layout"], r["shape"], r["rows"], "dequantize_then_matmul"))
        dense = by_key.get((r["layout"], r["shape"], r["rows"], "dense_float"))
        ratio = f"{base / r['us']:.2f}x" if base else "-"
        ratio_dense = f"{dense / r['us']:.2f}x" if dense else "-"
        lines.append(
            f"| {r['layout']} | {r['shape']} | {r['rows']} | {r['impl']} | {r['us']:.1f} | {ratio} | {ratio_dense} |"
        )
    (OUT_DIR / "quant.md").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["layout"], r["rows"]) for r in _RESULTS})
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.6), squeeze=False)
    for ax, (layout, rows) in zip(axes[0], panels):
        sel = [r for r in _RESULTS if r["layout"] == layout and r["rows"] == rows]
        shapes = list(dict.fromkeys(r["shape"] for r in sel))
        for i, impl in enumerate(IMPLS):
            us = [by_key.get((layout, s, rows, impl), 0.0) for s in shapes]
            width = 0.8 / len(IMPLS)
            ax.bar([j + width * i for j in range(len(shapes))], us, width=width, label=impl)
        ax.set_xticks(range(len(shapes)), shapes, rotation=30, fontsize=7)
        ax.set_yscale("log")
        ax.set_title(f"{layout}, {rows} rows", fontsize=9)
        ax.set_ylabel("µs (median)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT_DIR / "quant.png", dpi=120)
    plt.close(fig)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_quant_matmul(benchmark, layout: str, shape: tuple[int, int], rows: int, impl: str) -> None:
    n, k = shape
    weight = _weight(n, k, layout)
    x = torch.randn(rows, k, device="cuda" if CUDA else "cpu", dtype=torch.bfloat16 if CUDA else torch.float32)
    run = _fn(impl, weight, x)

    def fn() -> None:
        run()
        if CUDA:
            torch.cuda.synchronize()

    benchmark.pedantic(fn, rounds=5 if n * rows > 1 << 21 else 20, warmup_rounds=1)
    stats = getattr(benchmark, "stats", None)
    if stats is not None:
        _RESULTS.append(
            {"layout": layout, "shape": f"{n}x{k}", "rows": rows, "impl": impl, "us": stats.stats.median * 1e6}
        )
