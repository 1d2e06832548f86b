"""Which operations of a decoder step are batch invariant on this device: a row's result, bit for bit,
whatever the number of rows computed with it.

The engine's end-to-end check (`bench/gpu_engine.py`) found greedy outputs that depend on the batch on
CUDA while the attention kernel is bitwise invariant (`bench/gpu_check.py`): cuBLAS and the quantized
matmuls' M-dependent tiling were the cause, and the layers now take `helexa.kernels.linear` (one tiling
for every M) and M-independent quantized configs. This script runs each other
operation of a Llama step at the shapes of that check's model (hidden 2048, 32 query / 8 KV heads of 64,
MLP 8192, vocabulary 32000) on M = 1, 3, 16, 64, 200 and 512 rows, and compares the first rows of each
with the same rows computed alone (M = 1). Prints a markdown table (and writes it to `--out`).
`--dry-run` runs it on the CPU with small shapes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]
if "--dry-run" in sys.argv:  # before the first triton import: the quantized matmuls run in the interpreter
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from helexa.kernels import linear, quant_reference  # noqa: E402
from helexa.kernels.dense_matmul import dense_matmul_triton  # noqa: E402
from helexa.kernels.quant_matmul import int4_matmul, int8_matmul  # noqa: E402

LINES: list[str] = []


def emit(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def invariant(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, ms: list[int], rows: int = 3) -> str:
    """Compare rows [0, rows) of fn(x[:m]) for each m with each row computed alone."""
    alone = torch.cat([fn(x[i : i + 1]) for i in range(rows)])
    worst, differing = 0.0, []
    for m in ms:
        got = fn(x[:m])[:rows]
        if not torch.equal(got, alone):
            differing.append(m)
            worst = max(worst, (got.float() - alone.float()).abs().max().item())
    if not differing:
        return "bitwise | - | -"
    return f"DIFFERS | M = {', '.join(map(str, differing))} | {worst:.2e}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).parent / "out" / "gpu_invariance.md"))
    args = parser.parse_args()
    dry = args.dry_run
    dev = "cpu" if dry else "cuda"
    hidden, inter, vocab, qkv = (64, 128, 512, 128) if dry else (2048, 8192, 32000, 3072)
    ms = [3, 16, 64] if dry else [3, 16, 64, 200, 512]
    dtype = torch.float32 if dry else torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=dev) * scale).to(dtype)

    start = time.perf_counter()
    name = "CPU (dry run)" if dry else torch.cuda.get_device_name()
    emit(f"# helexa gpu_invariance — {name}; torch {torch.__version__}; rows compared with the same rows alone")
    emit()
    emit("| operation | shape (K -> N) | result | differs at | max abs diff |")
    emit("|---|---|---|---|---|")
    x_h, x_i = rand(512, hidden), rand(512, inter)
    cases: list[tuple[str, str, Callable[[torch.Tensor], torch.Tensor], torch.Tensor]] = []
    for label, k, n, x in (("qkv_proj", hidden, qkv, x_h), ("gate_up_proj", hidden, 2 * inter, x_h),
                           ("down_proj", inter, hidden, x_i), ("lm_head", hidden, vocab, x_h)):  # fmt: skip
        w = rand(n, k, scale=k**-0.5)
        cases.append(
            (f"F.linear {str(dtype).removeprefix('torch.')} ({label})", f"{k} -> {n}", lambda a, w=w: F.linear(a, w), x)
        )
        layer = "helexa.kernels.linear (the layers' dense matmul)"
        cases.append(
            (
                f"{layer} ({label})",
                f"{k} -> {n}",
                lambda a, w=w: linear(a, w) if a.is_cuda else dense_matmul_triton(a, w),
                x,
            )
        )
        cases.append((f"F.linear, then .float() ({label})", f"{k} -> {n}", lambda a, w=w: F.linear(a, w).float(), x))
        group = min(k, 128)
        codes = torch.randint(0, 16, (n, k), generator=gen, device=dev, dtype=torch.uint8)
        packed = quant_reference.pack_int4(codes)
        scales = (torch.rand((n, k // group), generator=gen, device=dev) / 64 + 1e-3).to(dtype)
        zeros = (torch.randn((n, k // group), generator=gen, device=dev) / 64).to(dtype)
        cases.append((f"int4 W4A16 G128 (helexa Triton) ({label})", f"{k} -> {n}",
                      lambda a, p=packed, s=scales, z=zeros: int4_matmul(a, p, s, z), x))  # fmt: skip
        q8 = torch.randint(-128, 128, (n, k), generator=gen, device=dev, dtype=torch.int8)
        s8 = (torch.rand((n,), generator=gen, device=dev) / 256 + 1e-4).float()
        cases.append(
            (
                f"int8 per-channel (helexa Triton) ({label})",
                f"{k} -> {n}",
                lambda a, q=q8, s=s8: int8_matmul(a, q, s),
                x,
            )
        )
    norm_w = rand(hidden)

    def rms_norm(a: torch.Tensor) -> torch.Tensor:  # helexa's RMSNorm.forward
        return norm_w * F.rms_norm(a.float(), a.shape[-1:], eps=1e-6).to(a.dtype)

    def swiglu(a: torch.Tensor) -> torch.Tensor:
        return F.silu(a[:, :inter]) * a[:, inter:]

    logits = rand(512, vocab, scale=3.0)
    cases += [
        ("RMSNorm (F.rms_norm in fp32, helexa's)", f"{hidden}", rms_norm, x_h),
        ("silu(gate) * up", f"{2 * inter} -> {inter}", swiglu, torch.cat([x_i, x_i.flip(0)], 1)),
        ("log_softmax fp32 (logprobs)", f"{vocab}", lambda a: torch.log_softmax(a.float(), -1), logits),
        ("argmax fp32 (greedy)", f"{vocab}", lambda a: torch.argmax(a.float(), -1), logits),
    ]  # fmt: skip
    for label, shape, fn, x in cases:
        try:
            emit(f"| {label} | {shape} | {invariant(fn, x, ms)} |")
        except Exception as exc:
            emit(f"| {label} | {shape} | ERROR {exc!r:.100} | | |")
    if not dry:  # cuBLAS without the reduced-precision reductions it may use for 16-bit outputs
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        for label, shape, fn, x in cases:
            if label.startswith("F.linear"):
                emit(f"| {label}, reduced-precision reduction off | {shape} | {invariant(fn, x, ms)} |")
    emit()
    emit(f"finished in {time.perf_counter() - start:.0f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(LINES) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
