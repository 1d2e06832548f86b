"""Kernel microbenchmarks: Triton kernels vs the torch reference vs SDPA on a contiguous copy.

`make bench` runs them with pytest-benchmark. Each benchmark prints the achieved GB/s (decode and
write_kv: bytes that must move — K+V+Q+O for decode) or TFLOP/s (prefill, causal FLOPs) next to the
baselines measured in the same run, and the module writes `bench/out/kernels.md` and
`bench/out/kernels.png` at the end. On CUDA the shapes are production-sized (bf16, head_dim 128,
32 query / 8 KV heads); on CPU they are small, and only the torch reference and SDPA run: the
Triton kernels on CPU would run in the interpreter, which measures Python, not the kernel.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from kernel_problems import gathered_sdpa, make_problem

from helexa.kernels import reference
from helexa.kernels.attention import paged_attention_triton
from helexa.kernels.kv_write import write_kv_triton

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
DEVICE = "cuda" if CUDA else "cpu"
OUT_DIR = Path(__file__).parent / "out"

if CUDA:
    HEADS, KV_HEADS, HEAD_DIM, BLOCK, DTYPE = 32, 8, 128, 16, torch.bfloat16
    DECODE = ("decode B64x8k", [(8191, 1)] * 64)
    PREFILL = ("prefill 8k causal", [(0, 8192)])
    WRITE_TOKENS = 8192
else:
    HEADS, KV_HEADS, HEAD_DIM, BLOCK, DTYPE = 8, 2, 64, 16, torch.float32
    DECODE = ("decode B4x512", [(511, 1)] * 4)
    PREFILL = ("prefill 512 causal", [(0, 512)])
    WRITE_TOKENS = 512

IMPLS = ["triton", "torch_reference", "sdpa_gathered"]
_RESULTS: list[dict] = []


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _timed(fn):
    def run():
        fn()
        _sync()

    return run


def _median_seconds(benchmark) -> float | None:
    stats = getattr(benchmark, "stats", None)
    if stats is None:  # --benchmark-disable: the function ran once, untimed
        return None
    return float(stats.stats.median)


def _record(benchmark, kernel: str, shape: str, impl: str, amount: float, unit: str) -> None:
    seconds = _median_seconds(benchmark)
    if seconds is None or seconds <= 0:
        return
    rate = amount / seconds / (1e9 if unit == "GB/s" else 1e12)
    benchmark.extra_info.update({"shape": shape, unit: round(rate, 3)})
    _RESULTS.append({"kernel": kernel, "shape": shape, "impl": impl, "us": seconds * 1e6, "rate": rate, "unit": unit})
    print(f"\n{kernel:>10} {shape:<22} {impl:<16} {seconds * 1e6:12.1f} us {rate:10.3f} {unit}")


def _skip_triton_on_cpu(impl: str) -> None:
    if impl == "triton" and not CUDA:
        pytest.skip("Triton kernels are benchmarked only on CUDA (on CPU they run in the interpreter)")


@pytest.fixture(scope="module", autouse=True)
def _write_report():
    yield
    if not _RESULTS:
        return
    OUT_DIR.mkdir(exist_ok=True)
    lines = [
        f"# kernel microbenchmarks ({torch.cuda.get_device_name() if CUDA else 'CPU'}, {DTYPE}, "
        f"{HEADS}q/{KV_HEADS}kv heads, head_dim {HEAD_DIM}, block {BLOCK})",
        "",
        "| kernel | shape | impl | median µs | achieved |",
        "|---|---|---|---:|---:|",
    ]
    for r in _RESULTS:
        lines.append(f"| {r['kernel']} | {r['shape']} | {r['impl']} | {r['us']:.1f} | {r['rate']:.3f} {r['unit']} |")
    (OUT_DIR / "kernels.md").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kernels = list(dict.fromkeys(r["kernel"] for r in _RESULTS))
    fig, axes = plt.subplots(1, len(kernels), figsize=(4.5 * len(kernels), 3.5), squeeze=False)
    for ax, kernel in zip(axes[0], kernels):
        rows = [r for r in _RESULTS if r["kernel"] == kernel]
        ax.bar([r["impl"] for r in rows], [r["rate"] for r in rows], color="tab:blue")
        ax.set_title(f"{kernel}: {rows[0]['shape']}")
        ax.set_ylabel(rows[0]["unit"])
        ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(OUT_DIR / "kernels.png", dpi=120)
    plt.close(fig)


@pytest.fixture(scope="module")
def decode_problem():
    return make_problem(DECODE[0], DECODE[1], HEADS, KV_HEADS, HEAD_DIM, BLOCK, DTYPE, DEVICE, seed=1)


@pytest.fixture(scope="module")
def prefill_problem():
    return make_problem(PREFILL[0], PREFILL[1], HEADS, KV_HEADS, HEAD_DIM, BLOCK, DTYPE, DEVICE, seed=2)


def _attention_fn(problem, impl):
    if impl == "triton":
        return lambda: paged_attention_triton(*problem.args())
    if impl == "torch_reference":
        return lambda: reference.paged_attention(*problem.args())
    return gathered_sdpa(problem)


@pytest.mark.parametrize("impl", IMPLS)
def test_decode(benchmark, decode_problem, impl):
    _skip_triton_on_cpu(impl)
    if impl == "torch_reference" and CUDA:
        pytest.skip("the reference loops over sequences on the host; the baseline on CUDA is SDPA")
    benchmark.group = "paged_attention decode"
    benchmark(_timed(_attention_fn(decode_problem, impl)))
    _record(benchmark, "decode", decode_problem.name, impl, decode_problem.decode_bytes, "GB/s")


@pytest.mark.parametrize("impl", IMPLS)
def test_prefill(benchmark, prefill_problem, impl):
    _skip_triton_on_cpu(impl)
    benchmark.group = "paged_attention prefill"
    benchmark(_timed(_attention_fn(prefill_problem, impl)))
    _record(benchmark, "prefill", prefill_problem.name, impl, prefill_problem.causal_flops, "TFLOP/s")


@pytest.mark.parametrize("impl", ["triton", "torch_reference"])
def test_write_kv(benchmark, impl):
    _skip_triton_on_cpu(impl)
    benchmark.group = "write_kv"
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    num_blocks = WRITE_TOKENS // BLOCK + 8
    cache_shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(cache_shape, generator=gen, device=DEVICE, dtype=DTYPE)
    v_cache = torch.randn(cache_shape, generator=gen, device=DEVICE, dtype=DTYPE)
    k = torch.randn((WRITE_TOKENS, KV_HEADS, HEAD_DIM), generator=gen, device=DEVICE, dtype=DTYPE)
    v = torch.randn((WRITE_TOKENS, KV_HEADS, HEAD_DIM), generator=gen, device=DEVICE, dtype=DTYPE)
    slots = torch.randperm(num_blocks * BLOCK, generator=gen, device=DEVICE)[:WRITE_TOKENS]
    fn = write_kv_triton if impl == "triton" else reference.write_kv
    benchmark(_timed(lambda: fn(k, v, k_cache, v_cache, slots)))
    moved = 2 * 2 * k.numel() * k.element_size() + slots.numel() * slots.element_size()  # read + write K and V
    _record(benchmark, "write_kv", f"{WRITE_TOKENS} tokens", impl, moved, "GB/s")
