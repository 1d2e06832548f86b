"""One-shot GPU check of helexa's kernels: compile, verify against the reference, then time.

Run by `bench/gpu_check.sh` on a CUDA machine (torch 2.11 / triton 3.6, no network):

1. checks — every Triton kernel configuration the engine uses (fp32/fp16/bf16; head_dim
   64/80/96/128/256; MHA/GQA/MQA; block sizes 8..64; decode (split) and mixed prefill/extend
   batches; a >2^31-element pool) against the fp64 torch reference on random inputs;
2. copy bandwidth of the device, measured in this run (the roofline for decode);
3. timings with `triton.testing.do_bench` (median; it flushes L2 before every repetition) of
   decode, prefill and write_kv at the issue's shapes (bf16, head_dim 128, 32 query / 8 KV heads),
   each next to SDPA on a gathered contiguous copy, and each output compared with SDPA's;
4. the allocator kernels of `helexa/kernels/block_alloc.py`;
5. the weight-only quantized matmuls of `helexa/kernels/quant_matmul.py` (int8 per-channel and
   group-wise, int4 group-wise): checks against the fp64 dequantize-then-matmul reference (bf16
   activations, decode M=1/16/64 and prefill M=512, N x K = 4096 x 4096 and 14336 x 4096, G=32/128),
   then timings next to `torch.matmul` on the dequantized bf16 weight, as GB/s of weight bytes read
   (the decode roofline, compared with the copy bandwidth) and TFLOP/s, plus a small config sweep.

Prints one table (also written to bench/out/gpu_check.md) and exits non-zero if any check failed.
`--dry-run` runs the same logic on CPU through the Triton interpreter with tiny shapes.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

_ARGS = argparse.ArgumentParser(description=__doc__.split("\n")[0])
_ARGS.add_argument("--dry-run", action="store_true", help="CPU + TRITON_INTERPRET=1, tiny shapes")
_ARGS.add_argument("--budget-s", type=float, default=450.0, help="skip remaining timings after this many seconds")
_ARGS.add_argument("--out", default=str(Path(__file__).parent / "out" / "gpu_check.md"))
_ARGS.add_argument(
    "--only", choices=("all", "attention", "quant"), default="all", help="run only the attention/KV/allocator "
    "sections (1-4) or only the quantized matmul section (5); the copy bandwidth is always measured"
)  # fmt: skip
ARGS = _ARGS.parse_args()
if ARGS.dry_run:  # must precede the first triton import: @triton.jit decides at decoration time
    os.environ["TRITON_INTERPRET"] = "1"

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import torch  # noqa: E402
import triton  # noqa: E402
from kernel_problems import Problem, gathered_sdpa, make_problem  # noqa: E402

from helexa.kernels import (  # noqa: E402
    FP8_KV_DTYPE,  # noqa: E402
    block_alloc,
    quant_reference,
    reference,
)
from helexa.kernels.attention import SPLIT_KEYS, paged_attention_triton  # noqa: E402
from helexa.kernels.dense_matmul import dense_config, dense_matmul_triton  # noqa: E402
from helexa.kernels.kv_write import write_kv_triton  # noqa: E402
from helexa.kernels.quant_matmul import QuantMatmulConfig, choose_config, int4_matmul_triton, int8_matmul_triton  # noqa: E402
from helexa.kvcache import BatchBuilder, BlockAllocator, BlockPool, OutOfBlocks, fp8_scales  # noqa: E402

DRY = ARGS.dry_run
if not DRY and not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device (use --dry-run to exercise the script on CPU)")
DEVICE = "cpu" if DRY else "cuda"
START = time.perf_counter()
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
FAILURES: list[str] = []
LINES: list[str] = []


def emit(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def elapsed() -> float:
    return time.perf_counter() - START


def sync() -> None:
    if not DRY:
        torch.cuda.synchronize()


def median_seconds(fn) -> float:
    """Median time of fn: do_bench on CUDA (L2 flushed before each rep), wall clock in a dry run."""
    if DRY:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[1]
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max())


# ---------------------------------------------------------------------------------------------
# 1. checks against the fp64 reference
# ---------------------------------------------------------------------------------------------
MIXED = [(37, 1), (0, 70), (150, 33), (5, 1), (0, 3), (300, 1)]  # decode, prefill, extend, ragged
DECODE = [(700, 1), (3, 1), (129, 1), (1000, 1)]
if DRY:
    MIXED = [(21, 1), (0, 12), (9, 4)]
    DECODE = [(40, 1), (3, 1)]


def check_attention(label: str, seqs, heads, kv_heads, head_dim, block_size, dtype, **kw) -> None:
    p = make_problem(label, seqs, heads, kv_heads, head_dim, block_size, dtype, DEVICE, seed=len(FAILURES) + head_dim)
    out = torch.full_like(p.q, float("nan"))
    paged_attention_triton(*p.args(), out=out, **kw)
    ref = reference.paged_attention(p.q.double(), p.k_cache.double(), p.v_cache.double(), *p.args()[3:])
    err = rel_err(out, ref)
    ok = err < TOLERANCE[dtype]
    if not ok:
        FAILURES.append(f"{label}: rel err {err:.2e}")
    emit(f"| {label} | {str(dtype).removeprefix('torch.')} | {err:.2e} | {'ok' if ok else 'FAIL'} |")


def check_batch_invariance(heads, kv_heads, head_dim, dtype) -> None:
    """The same queries computed in a mixed batch, each sequence alone, and each query as a decode row
    (the split launch and its reduce): bitwise-equal outputs (the fixed split length)."""
    seqs = [(37, 1), (0, 23), (18, 9), (40, 3), (0, 3)] if DRY else [(3000, 1), (0, 700), (1500, 300), (9000, 5)]
    knobs = dict(tile_n=16, split_keys=32) if DRY else {}  # on the device: the defaults the engine runs
    p = make_problem("invariance", seqs, heads, kv_heads, head_dim, 16, dtype, DEVICE, seed=21)
    batch = paged_attention_triton(*p.args(), **knobs)
    starts = p.query_start_loc.tolist()
    ok = True
    for b in range(len(seqs)):
        alone = paged_attention_triton(
            p.q[starts[b] : starts[b + 1]], p.k_cache, p.v_cache, p.block_tables[b : b + 1], p.seq_lens[b : b + 1],
            torch.tensor([0, starts[b + 1] - starts[b]], dtype=torch.int32, device=DEVICE), **knobs,
        )  # fmt: skip
        ok &= torch.equal(alone, batch[starts[b] : starts[b + 1]])
    owner = [b for b, (_, n) in enumerate(seqs) for _ in range(n)]
    lens = [pre + i + 1 for pre, n in seqs for i in range(n)]
    decode = paged_attention_triton(
        p.q, p.k_cache, p.v_cache, p.block_tables[owner].contiguous(),
        torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        torch.arange(len(lens) + 1, dtype=torch.int32, device=DEVICE), **knobs,
    )  # fmt: skip
    ok &= torch.equal(decode, batch)
    label = f"batch invariance (alone, in a batch, as decode rows) {heads}q/{kv_heads}kv D{head_dim}"
    if not ok:
        FAILURES.append(f"{label} {dtype}: outputs differ")
    emit(f"| {label} | {str(dtype).removeprefix('torch.')} | bitwise | {'ok' if ok else 'FAIL'} |")


def check_write_kv(label: str, kv_heads, head_dim, block_size, dtype) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(head_dim)
    shape = (12, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
    v_cache = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
    k = torch.randn((20, kv_heads, head_dim), generator=gen, device=DEVICE).to(dtype)
    v = torch.randn((20, kv_heads, head_dim), generator=gen, device=DEVICE).to(dtype)
    slots = torch.randperm(12 * block_size, generator=gen, device=DEVICE)[:20]
    slots[3] = -1
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv(k, v, k_ref, v_ref, slots)
    write_kv_triton(k, v, k_cache, v_cache, slots)
    ok = torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    if not ok:
        FAILURES.append(f"{label}: cache differs from the reference")
    emit(
        f"| {label} | {str(dtype).removeprefix('torch.')} | {'exact' if ok else 'differs'} | {'ok' if ok else 'FAIL'} |"
    )


def check_fp8(label: str, seqs, heads, kv_heads, head_dim, block_size, dtype) -> None:
    """An fp8 (e4m3) cache, one scale per KV head (heads of very different magnitudes): write_kv's bytes
    equal torch's cast, and attention matches fp64 attention over the dequantized cache."""
    p = make_problem(label, seqs, heads, kv_heads, head_dim, block_size, torch.float32, DEVICE, seed=head_dim + 3)
    magnitude = 4.0 ** torch.arange(kv_heads, dtype=torch.float32, device=DEVICE)[:, None]  # (KVH, 1)
    k_full, v_full = p.k_cache * magnitude, p.v_cache * (0.5 * magnitude)
    k_scale = fp8_scales(k_full.abs().amax(dim=(0, 1, 3)))
    v_scale = fp8_scales(v_full.abs().amax(dim=(0, 1, 3)))
    # write_kv: every row of the cache rewritten through the kernel, against torch's cast
    flat_k, flat_v = k_full.flatten(0, 1), v_full.flatten(0, 1)  # (NB*BS, KVH, D)
    slots = torch.randperm(flat_k.shape[0], device=DEVICE)
    k8 = torch.full(k_full.shape, float("nan"), device=DEVICE).to(FP8_KV_DTYPE)
    v8 = k8.clone()
    write_kv_triton(flat_k[slots].to(dtype), flat_v[slots].to(dtype), k8, v8, slots, k_scale=k_scale, v_scale=v_scale)
    k_ref = reference.quantize_fp8(flat_k[slots].to(dtype).float(), k_scale)
    v_ref = reference.quantize_fp8(flat_v[slots].to(dtype).float(), v_scale)
    written = torch.equal(k8.flatten(0, 1)[slots].view(torch.uint8), k_ref.view(torch.uint8)) and torch.equal(
        v8.flatten(0, 1)[slots].view(torch.uint8), v_ref.view(torch.uint8)
    )
    q = p.q.to(dtype)
    index = (p.block_tables, p.seq_lens, p.query_start_loc)
    out = torch.full_like(q, float("nan"))
    paged_attention_triton(q, k8, v8, *index, out=out, k_scale=k_scale, v_scale=v_scale)
    k64 = reference.dequantize_fp8(k8, k_scale, torch.float64)
    v64 = reference.dequantize_fp8(v8, v_scale, torch.float64)
    ref = reference.paged_attention(q.double(), k64, v64, *index)
    err = rel_err(out, ref)
    ok = written and err < TOLERANCE[dtype]
    if not ok:
        FAILURES.append(f"{label} {dtype}: write_kv bytes equal={written}, attention rel err {err:.2e}")
    emit(f"| {label} | {str(dtype).removeprefix('torch.')} | {err:.2e}; write_kv {'exact' if written else 'DIFFERS'} "
         f"| {'ok' if ok else 'FAIL'} |")  # fmt: skip


def check_allocator_agreement(steps: int) -> None:
    """Random allocate/free/incref/decref/new-table/build/release on a pool on this device (Triton allocator
    kernels) and on a CPU pool (torch): every outcome, every table and slot, and the free stack and
    reference counts equal after every operation (read back from the device: exact counts)."""
    rng = random.Random(3)
    num_blocks, block_size, max_seqs, max_len = 96, 4, 6, 64
    pools = [BlockPool(num_blocks, block_size, 1, 1, 8, torch.float32, d, backend=b)
             for d, b in ((DEVICE, "triton"), ("cpu", "torch"))]  # fmt: skip
    builders = [BatchBuilder(pool, max_num_seqs=max_seqs, max_model_len=max_len) for pool in pools]
    tables: list[list] = []  # [table on each pool, tokens]
    loose: list[int] = []  # blocks the check holds outside tables, one reference each
    mismatch = ""

    def outcome(fn):
        try:
            value = fn()
        except OutOfBlocks as e:
            return ("OutOfBlocks", e.requested, e.free)
        if isinstance(value, torch.Tensor):
            return ("ok", value.tolist())
        if value is not None and hasattr(value, "slot_mapping"):
            return ("ok", value.slot_mapping.tolist(), value.block_tables.tolist())
        return ("ok", value)

    ops = 0
    for ops in range(1, steps + 1):
        op = rng.choice(["allocate", "free", "incref", "new_table", "build", "build", "release"])
        if op == "allocate":
            n = rng.randint(0, 6)
            results = [outcome(lambda p=p, n=n: p.allocate(n)) for p in pools]
            if results[0][0] == "ok":
                loose += results[0][1]
        elif op in ("free", "incref") and loose:
            distinct = sorted(set(loose))  # one call takes each id once
            ids = rng.sample(distinct, rng.randint(1, min(3, len(distinct))))
            results = [
                outcome(lambda p=p, op=op, ids=ids: getattr(p, "free" if op == "free" else "incref")(ids))
                for p in pools
            ]
            for b in ids:
                (loose.remove if op == "free" else loose.append)(b)
        elif op == "new_table" and len(tables) < max_seqs:
            tables.append([[b.new_table() for b in builders], 0])
            results = [("ok",)] * 2
        elif op == "release" and tables:
            entry = tables.pop(rng.randrange(len(tables)))
            results = [
                outcome(lambda p=p, b=b, t=t: p.decref(b.release(t))) for p, b, t in zip(pools, builders, entry[0])
            ]
        elif op == "build" and tables:
            chosen = rng.sample(tables, rng.randint(1, len(tables)))
            counts = [rng.randint(1, min(9, max_len - e[1])) if e[1] < max_len else 0 for e in chosen]
            pairs = [(e, n) for e, n in zip(chosen, counts) if n]
            if not pairs:
                continue
            results = [
                outcome(lambda i=i, b=b, pairs=pairs: b.build([(e[0][i], n) for e, n in pairs]))
                for i, b in enumerate(builders)
            ]
            if results[0][0] == "ok":
                for e, n in pairs:
                    e[1] += n
        else:
            continue
        a, c = pools[0].allocator, pools[1].allocator
        top = int(a.top_counter.item())
        states = [(int(x.top_counter.item()), x.stack[:top].tolist(), x.refcount.tolist()) for x in (a, c)]
        if results[0] != results[1] or states[0] != states[1] or top != a.num_free_blocks:
            mismatch = f"op {ops} ({op}): {results[0]!r:.80} vs {results[1]!r:.80}"
            break
        for b in builders:
            b.check_integrity()
    ok = not mismatch
    if not ok:
        FAILURES.append(f"allocator agreement: {mismatch}")
    emit(f"| allocator kernels vs torch allocator, {ops} random operations ({num_blocks} blocks) | int32 | "
         f"{'exact' if ok else mismatch} | {'ok' if ok else 'FAIL'} |")  # fmt: skip


def check_large_pool() -> None:
    """write_kv + attention through blocks above element 2^31 of a real pool."""
    block_size, kv_heads, head_dim = 16, 2, 64
    num_blocks = (1 << 31) // (block_size * kv_heads * head_dim) + 64
    k_cache = torch.empty((num_blocks, block_size, kv_heads, head_dim), dtype=torch.float16, device=DEVICE)
    v_cache = torch.empty_like(k_cache)
    top = [num_blocks - 1, num_blocks - 40, 7, num_blocks - 3]
    seq_len = len(top) * block_size - 5
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    k = torch.randn((seq_len, kv_heads, head_dim), generator=gen, device=DEVICE).half()
    v = torch.randn((seq_len, kv_heads, head_dim), generator=gen, device=DEVICE).half()
    slots = torch.tensor([top[i // block_size] * block_size + i % block_size for i in range(seq_len)], device=DEVICE)
    write_kv_triton(k, v, k_cache, v_cache, slots)
    q = torch.randn((6, 4, head_dim), generator=gen, device=DEVICE).half()
    table = torch.tensor([top, top], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([seq_len, seq_len - 10], dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, 5, 6], dtype=torch.int32, device=DEVICE)
    out = paged_attention_triton(q, k_cache, v_cache, table, seq_lens, qsl)
    small = (k_cache[top].double().contiguous(), v_cache[top].double().contiguous())  # the 4 blocks as 0..3
    small_table = torch.arange(4, dtype=torch.int32, device=DEVICE).expand(2, -1).contiguous()
    ref = reference.paged_attention(q.double(), *small, small_table, seq_lens, qsl)
    written = torch.equal(k_cache[torch.tensor(top, device=DEVICE)].flatten(0, 1)[:seq_len], k)
    err = rel_err(out, ref)
    ok = written and err < TOLERANCE[torch.float16]
    if not ok:
        FAILURES.append(f"large pool: written={written} rel err {err:.2e}")
    emit(
        f"| pool of {k_cache.numel() / 2**31:.3f} x 2^31 elements, top blocks | float16 | {err:.2e} "
        f"| {'ok' if ok else 'FAIL'} |"
    )
    del k_cache, v_cache


def run_checks() -> None:
    emit("## checks against the fp64 reference (max |err| / max |ref|)")
    emit()
    emit("| case | dtype | error | result |")
    emit("|---|---|---:|---|")
    dims = [64] if DRY else [64, 80, 96, 128, 256]
    main_dim = 64 if DRY else 128
    heads, kv = (8, 2) if DRY else (32, 8)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        check_attention(f"mixed batch D{main_dim} {heads}q/{kv}kv", MIXED, heads, kv, main_dim, 16, dtype)
        check_attention(f"decode batch (split) D{main_dim} {heads}q/{kv}kv", DECODE, heads, kv, main_dim, 16, dtype)
        check_write_kv(f"write_kv {kv}kv D{main_dim}", kv, main_dim, 16, dtype)
    for d in dims:
        if d != main_dim:
            check_attention(f"mixed batch D{d}", MIXED, heads, kv, d, 16, torch.bfloat16)
            check_attention(f"decode batch (split) D{d}", DECODE, heads, kv, d, 16, torch.bfloat16)
            check_write_kv(f"write_kv D{d}", kv, d, 16, torch.bfloat16)
    for h, k in [(4, 4), (8, 1), (6, 2)] if DRY else [(8, 8), (32, 4), (16, 1), (12, 4)]:
        check_attention(f"mixed batch {h}q/{k}kv", MIXED, h, k, main_dim, 16, torch.bfloat16)
        check_attention(f"decode batch (split) {h}q/{k}kv", DECODE, h, k, main_dim, 16, torch.bfloat16)
    for bs in (8, 32, 64):
        check_attention(f"mixed batch block {bs}", MIXED, heads, kv, main_dim, bs, torch.bfloat16)
    check_attention(
        "mixed batch split every 32 keys", MIXED, heads, kv, main_dim, 16, torch.bfloat16, tile_n=16, split_keys=32
    )
    check_attention(
        "decode batch split every 32 keys", DECODE, heads, kv, main_dim, 16, torch.bfloat16, tile_n=16, split_keys=32
    )
    for dtype in (torch.float16, torch.bfloat16):
        for bs in (16, 32):
            check_fp8(f"fp8 KV mixed batch block {bs} {heads}q/{kv}kv", MIXED, heads, kv, main_dim, bs, dtype)
            check_fp8(f"fp8 KV decode batch (split) block {bs} {heads}q/{kv}kv", DECODE, heads, kv, main_dim, bs, dtype)
    for h, k in [(8, 8), (8, 1)] if DRY else [(32, 32), (32, 4)]:  # GQA group 1 and 8 (4 above)
        check_fp8(f"fp8 KV mixed batch {h}q/{k}kv", MIXED, h, k, main_dim, 16, torch.bfloat16)
    for dtype in (torch.float32, torch.bfloat16):
        check_batch_invariance(heads, kv, main_dim, dtype)
    check_allocator_agreement(60 if DRY else 400)
    if not DRY:
        check_large_pool()
    emit()


# ---------------------------------------------------------------------------------------------
# 2. copy bandwidth
# ---------------------------------------------------------------------------------------------
COPY_BYTES = (1 << 22) if DRY else (1 << 30)  # per buffer


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting the read and the write."""
    src = torch.randn(COPY_BYTES // 4, device=DEVICE)
    dst = torch.empty_like(src)
    t = median_seconds(lambda: dst.copy_(src))
    return 2 * COPY_BYTES / t


# ---------------------------------------------------------------------------------------------
# 3. timings
# ---------------------------------------------------------------------------------------------
HEADS, KV_HEADS, HEAD_DIM, DTYPE = (8, 2, 64, torch.bfloat16) if DRY else (32, 8, 128, torch.bfloat16)


def _ragged(batch: int, lo: int, hi: int) -> list[tuple[int, int]]:
    gen = torch.Generator().manual_seed(7)
    return [(int(n) - 1, 1) for n in torch.randint(lo, hi + 1, (batch,), generator=gen)]


if DRY:
    DECODE_SHAPES = [("B1x256", [(255, 1)], 16), ("B4x64", [(63, 1)] * 4, 16),
                     ("ragged 16-128", _ragged(4, 16, 128), 16), ("B4x64", [(63, 1)] * 4, 32)]  # fmt: skip
    PREFILL_SHAPES = [("prefill 128 causal", [(0, 128)]), ("32 chunk over 96", [(96, 32)]),
                      ("4x32 varlen", [(0, 32)] * 4)]  # fmt: skip
    WRITE_TOKENS = 256
else:
    DECODE_SHAPES = [("B1x32k", [(32767, 1)], 16), ("B8x8k", [(8191, 1)] * 8, 16), ("B32x4k", [(4095, 1)] * 32, 16),
                     ("B64x8k", [(8191, 1)] * 64, 16), ("B256x1k", [(1023, 1)] * 256, 16),
                     ("ragged B64 256-4k", _ragged(64, 256, 4096), 16),
                     ("B64x8k", [(8191, 1)] * 64, 32), ("B64x8k", [(8191, 1)] * 64, 64),
                     ("ragged B64 256-4k", _ragged(64, 256, 4096), 32),
                     ("ragged B64 256-4k", _ragged(64, 256, 4096), 64)]  # fmt: skip
    PREFILL_SHAPES = [("prefill 8k causal", [(0, 8192)]), ("2k chunk over 6k prefix", [(6144, 2048)]),
                      ("16x1k varlen", [(0, 1024)] * 16)]  # fmt: skip
    WRITE_TOKENS = 8192


def _sdpa_error(p: Problem, ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Our (T, H, D) output against SDPA's padded (B, H, L, D) output, same inputs."""
    starts = p.query_start_loc.tolist()
    rows = [theirs[b, :, :n].transpose(0, 1) for b, (_, n) in enumerate(p.seqs)]
    return rel_err(ours, torch.cat(rows)[: starts[-1]])


def time_attention(kind: str, name: str, seqs, block_size: int, copy_bw: float) -> None:
    p = make_problem(name, seqs, HEADS, KV_HEADS, HEAD_DIM, block_size, DTYPE, DEVICE, seed=11)
    ours_fn = functools.partial(paged_attention_triton, *p.args())
    sdpa_fn = gathered_sdpa(p)
    err = _sdpa_error(p, ours_fn(), sdpa_fn())
    ok = err < TOLERANCE[DTYPE]
    if not ok:
        FAILURES.append(f"{kind} {name}: differs from SDPA by {err:.2e}")
    t_ours, t_sdpa = median_seconds(ours_fn), median_seconds(sdpa_fn)
    if kind == "decode":
        splits = -(-p.block_tables.shape[1] * block_size // SPLIT_KEYS)  # the fixed split length's programs
        ours_rate, sdpa_rate = p.decode_bytes / t_ours / 1e9, p.decode_bytes / t_sdpa / 1e9
        emit(
            f"| decode | {name} | {block_size} | {splits} | {t_ours * 1e6:9.1f} | {ours_rate:8.1f} GB/s | "
            f"{ours_rate * 1e9 / copy_bw:6.1%} | {t_sdpa * 1e6:9.1f} | {sdpa_rate:8.1f} GB/s | "
            f"{err:.1e} {'ok' if ok else 'FAIL'} |"
        )
    else:
        ours_rate, sdpa_rate = p.causal_flops / t_ours / 1e12, p.causal_flops / t_sdpa / 1e12
        emit(
            f"| prefill | {name} | {block_size} | 1 | {t_ours * 1e6:9.1f} | {ours_rate:8.1f} TFLOP/s | - | "
            f"{t_sdpa * 1e6:9.1f} | {sdpa_rate:8.1f} TFLOP/s | {err:.1e} {'ok' if ok else 'FAIL'} |"
        )
    del p, sdpa_fn


def time_write_kv(copy_bw: float) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    block_size = 16
    num_blocks = WRITE_TOKENS // block_size * 4
    shape = (num_blocks, block_size, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, device=DEVICE).to(DTYPE)
    v_cache = torch.randn(shape, generator=gen, device=DEVICE).to(DTYPE)
    k = torch.randn((WRITE_TOKENS, KV_HEADS, HEAD_DIM), generator=gen, device=DEVICE).to(DTYPE)
    v = torch.randn((WRITE_TOKENS, KV_HEADS, HEAD_DIM), generator=gen, device=DEVICE).to(DTYPE)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=DEVICE)[:WRITE_TOKENS]
    t_ours = median_seconds(lambda: write_kv_triton(k, v, k_cache, v_cache, slots))
    t_ref = median_seconds(lambda: reference.write_kv(k, v, k_cache, v_cache, slots))
    moved = 4 * k.numel() * k.element_size() + slots.numel() * slots.element_size()
    emit(
        f"| write_kv | {WRITE_TOKENS} tokens | {block_size} | - | {t_ours * 1e6:9.1f} "
        f"| {moved / t_ours / 1e9:8.1f} GB/s | {moved / t_ours / copy_bw:6.1%} | {t_ref * 1e6:9.1f} "
        f"| {moved / t_ref / 1e9:8.1f} GB/s (torch index_put) | exact |"
    )


# ---------------------------------------------------------------------------------------------
# 4. allocator kernels (helexa/kernels/block_alloc.py)
# ---------------------------------------------------------------------------------------------
def allocator_cases(device: str) -> list[tuple[str, Callable[[], None]]]:
    """Allocator launches on prepared inputs, each repeatable: a pool of 65536 blocks and 256 decoding
    sequences on CUDA (16 in a dry run). The operations run on the device state of a `BlockAllocator`
    directly (its host mirror is never consulted): pop and extend take the host `top` as an argument,
    so a rerun with the same `top` rewrites the same ids (only the device counter moves); "pop+push"
    pops blocks and pushes them back (same free set and refcounts, the segment reversed).
    """
    num_blocks, block_size = 65536, 16
    state = BlockAllocator(num_blocks, device, backend="triton")
    batch = 256 if state.device.type == "cuda" else 16
    tables = torch.zeros(batch, 64, dtype=torch.int32, device=device)  # (B, 64)
    rows = torch.arange(batch, dtype=torch.int32, device=device)  # (B,)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)  # (B+1,) one token each

    def pop_push() -> None:
        ids = block_alloc.pop_blocks(state, num_blocks, batch)
        block_alloc.push_blocks(state, num_blocks - batch, ids)

    def extend(context: int, total_new: int) -> Callable[[], None]:
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)  # (B,)
        alloc_start = rows.clone() if total_new else torch.zeros_like(rows)  # (B,)
        return lambda: block_alloc.extend_tables(
            state, num_blocks, total_new, tables, rows, seq_lens, qsl, alloc_start, 2, batch, block_size
        )

    return [
        (f"pop_blocks {batch}", lambda: block_alloc.pop_blocks(state, num_blocks, batch)),
        (f"pop+push {batch} blocks", pop_push),
        # context 16 -> 17 crosses into a second block; 17 -> 18 stays in it
        (f"extend_tables {batch} seqs decode, 1 new block each", extend(17, batch)),
        (f"extend_tables {batch} seqs decode, no new block", extend(18, 0)),
    ]


def time_allocator() -> None:
    for name, fn in allocator_cases(DEVICE):
        t = median_seconds(fn)
        emit(f"| allocator | {name} | - | - | {t * 1e6:9.1f} | - | - | - | - | - |")


# ---------------------------------------------------------------------------------------------
# 5. weight-only quantized matmuls (helexa/kernels/quant_matmul.py)
# ---------------------------------------------------------------------------------------------
QUANT_MS = [1, 5, 20] if DRY else [1, 16, 64, 512]
QUANT_NK = [(48, 128), (80, 256)] if DRY else [(4096, 4096), (14336, 4096)]
QUANT_GROUPS = [32, 64] if DRY else [32, 128]
# (label, bits, group, scale dtype): per-channel int8 with fp32 scales; G=32 (GGUF-like) fp16 scales;
# the larger group bf16 scales.
QUANT_KINDS = [("int8 per-channel", 8, 0, torch.float32)] + [
    (f"{name} G{g}", bits, g, torch.float16 if g == 32 else torch.bfloat16)
    for bits, name in ((8, "int8"), (4, "int4"))
    for g in QUANT_GROUPS
]


class QuantWeight:
    """A random quantized weight (N, K) of one kind on DEVICE, with its matmul and its bytes."""

    def __init__(self, bits: int, group: int, scale_dtype: torch.dtype, n: int, k: int, seed: int) -> None:
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.bits, self.group, self.n, self.k = bits, group, n, k
        groups = k // group if group else 0
        s_shape = (n, groups) if group else (n,)
        sign = torch.randint(0, 2, s_shape, generator=gen, device=DEVICE) * 2 - 1
        self.scales = ((torch.rand(s_shape, generator=gen, device=DEVICE) + 0.5) * sign / 256).to(scale_dtype)
        self.zeros: torch.Tensor | None = None
        if bits == 8:
            self.qweight = torch.randint(-128, 128, (n, k), generator=gen, device=DEVICE, dtype=torch.int8)
        else:
            codes = torch.randint(0, 16, (n, k), generator=gen, device=DEVICE, dtype=torch.uint8)
            self.qweight = quant_reference.pack_int4(codes)
            self.scales = self.scales * 16  # 4-bit steps: keep |W| in the int8 weight's range
            self.zeros = (torch.randn((n, groups), generator=gen, device=DEVICE) / 64).to(scale_dtype)
        self.bytes = sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros) if t is not None)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        if self.zeros is None:
            return quant_reference.dequantize_int8(self.qweight, self.scales, dtype=dtype)
        return quant_reference.dequantize_int4(self.qweight, self.scales, self.zeros, dtype=dtype)

    def matmul(self, x: torch.Tensor, out: torch.Tensor | None = None, config: QuantMatmulConfig | None = None):
        if self.zeros is None:
            return int8_matmul_triton(x, self.qweight, self.scales, out=out, config=config)
        return int4_matmul_triton(x, self.qweight, self.scales, self.zeros, out=out, config=config)


def _quant_config(m: int, w: QuantWeight, dtype: torch.dtype = torch.bfloat16) -> QuantMatmulConfig:
    """The config the wrappers choose by default for this problem here (4 SMs assumed in a dry run)."""
    sms = 4 if DRY else torch.cuda.get_device_properties(0).multi_processor_count
    return choose_config(w.n, w.k, w.group, sms, dtype)  # the same for every M (batch invariant)


def _cfg_text(cfg: QuantMatmulConfig) -> str:
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{cfg.split_k} w{cfg.num_warps} st{cfg.num_stages}"


def run_quant_checks() -> None:
    emit("## quantized matmul checks against the fp64 reference (max |err| / max |ref|, NaN-poisoned output)")
    emit()
    emit("| kernel | M | N x K | x dtype | scales | config | error | result |")
    emit("|---|---:|---|---|---|---|---:|---|")
    for n, k in QUANT_NK:
        for i, (label, bits, group, scale_dtype) in enumerate(QUANT_KINDS):
            w = QuantWeight(bits, group, scale_dtype, n, k, seed=100 + i)
            w64 = w.dequantized(torch.float64)  # (N, K)
            gen = torch.Generator(device=DEVICE).manual_seed(k + i)
            cases = [(m, torch.bfloat16) for m in QUANT_MS]
            cases += [(QUANT_MS[0], torch.float16), (QUANT_MS[-1], torch.float16)]
            cases += [(QUANT_MS[1], torch.float32), (QUANT_MS[-1], torch.float32)]
            for m, dtype in cases:
                x = torch.randn((m, k), generator=gen, device=DEVICE).to(dtype)
                out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
                w.matmul(x, out=out)
                err = rel_err(out, x.double() @ w64.T)
                ok = err < TOLERANCE[dtype]  # NaN fails
                if not ok:
                    FAILURES.append(f"{label} M{m} {n}x{k} {dtype}: rel err {err:.2e}")
                cfg = _cfg_text(_quant_config(m, w, dtype))
                emit(
                    f"| {label} | {m} | {n} x {k} | {str(dtype).removeprefix('torch.')} "
                    f"| {str(scale_dtype).removeprefix('torch.')} | {cfg} | {err:.2e} | {'ok' if ok else 'FAIL'} |"
                )
            del w, w64
            if not DRY:
                torch.cuda.empty_cache()
    emit()


def dense_section(copy_bw: float) -> None:
    """The batch-invariant dense matmul of the linear layers (`helexa.kernels.dense_matmul`): against fp64
    (NaN-poisoned output), the first rows of every M bitwise equal to the same rows alone, then its time
    next to torch.matmul (cuBLAS) on the same operands, as weight GB/s and TFLOP/s."""
    emit("## dense matmul of the linear layers (bf16; one tiling for every M; vs torch.matmul = cuBLAS)")
    emit()
    emit("| N x K | M | config | error | rows = alone | helexa µs | weight GB/s | of copy BW | TFLOP/s "
         "| torch µs | torch TFLOP/s | speed-up |")  # fmt: skip
    emit("|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    sms = 4 if DRY else torch.cuda.get_device_properties(0).multi_processor_count
    for n, k in QUANT_NK + ([] if DRY else [(2048, 8192), (32000, 2048)]):
        gen = torch.Generator(device=DEVICE).manual_seed(n + k)
        w = (torch.randn((n, k), generator=gen, device=DEVICE) / k**0.5).to(torch.bfloat16)
        x_all = torch.randn((max(QUANT_MS), k), generator=gen, device=DEVICE).to(torch.bfloat16)
        alone = torch.cat([dense_matmul_triton(x_all[i : i + 1], w) for i in range(3)])
        cfg = _cfg_text(dense_config(n, k, sms, torch.bfloat16))
        for m in QUANT_MS:
            x = x_all[:m]
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
            dense_matmul_triton(x, w, out=out)
            err = rel_err(out, x.double() @ w.double().T)
            same = m < 3 or torch.equal(out[:3], alone)
            ok = err < TOLERANCE[torch.bfloat16] and same
            if not ok:
                FAILURES.append(f"dense {n}x{k} M{m}: rel err {err:.2e}, rows equal alone: {same}")
            timing = "| skipped: over the budget | | | | | |"
            if elapsed() <= ARGS.budget_s:
                t_ours = median_seconds(lambda x=x, w=w: dense_matmul_triton(x, w))
                t_torch = median_seconds(lambda x=x, w=w: torch.matmul(x, w.T))
                flops, weight_bytes = 2 * m * n * k, 2 * n * k
                timing = (
                    f"| {t_ours * 1e6:9.1f} | {weight_bytes / t_ours / 1e9:8.1f} "
                    f"| {weight_bytes / t_ours / copy_bw:6.1%} "
                    f"| {flops / t_ours / 1e12:6.1f} | {t_torch * 1e6:9.1f} | {flops / t_torch / 1e12:6.1f} "
                    f"| {t_torch / t_ours:5.2f}x |"
                )
            emit(f"| {n} x {k} | {m} | {cfg} | {err:.2e} | {'yes' if same else 'NO'} {'ok' if ok else 'FAIL'} {timing}")
        del w, x_all
        if not DRY:
            torch.cuda.empty_cache()
    emit()


def time_quant(copy_bw: float) -> None:
    """Each kernel's median time against torch.matmul on the bf16 dequantized weight (same x),
    as weight GB/s (quantized bytes incl. scales/zeros for ours, bf16 bytes for torch) and TFLOP/s."""
    emit(
        f"## quantized matmul timings (bf16 x; GB/s = weight bytes read / time; device copy bandwidth "
        f"{copy_bw / 1e9:.0f} GB/s)"
    )
    emit()
    emit(
        "| kernel | M | N x K | config | helexa µs | weight GB/s | of copy BW | TFLOP/s "
        "| torch.matmul bf16 µs | its GB/s | its TFLOP/s | speed-up |"
    )
    emit("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, k in QUANT_NK:
        _time_quant_shape(n, k, copy_bw)
        if not DRY:
            torch.cuda.empty_cache()
    emit()


def _time_quant_shape(n: int, k: int, copy_bw: float) -> None:
    weights = [(label, QuantWeight(bits, g, sd, n, k, seed=7)) for label, bits, g, sd in QUANT_KINDS]
    w_bf16 = weights[0][1].dequantized(torch.bfloat16)  # (N, K): a dense baseline of the same size
    dense_bytes = w_bf16.numel() * w_bf16.element_size()
    for m in QUANT_MS:
        if elapsed() > ARGS.budget_s:
            emit(f"| quant | {m} | {n} x {k} | skipped: over the {ARGS.budget_s:.0f} s budget | | | | | | | | |")
            continue
        x = torch.randn((m, k), device=DEVICE).to(torch.bfloat16)  # (M, K)
        t_torch = median_seconds(functools.partial(torch.matmul, x, w_bf16.T))
        flops = 2.0 * m * n * k
        for label, w in weights:
            out = torch.empty((m, n), dtype=torch.bfloat16, device=DEVICE)
            t = median_seconds(functools.partial(w.matmul, x, out=out))
            emit(
                f"| {label} | {m} | {n} x {k} | {_cfg_text(_quant_config(m, w))} | {t * 1e6:9.1f} "
                f"| {w.bytes / t / 1e9:8.1f} | {w.bytes / t / copy_bw:6.1%} | {flops / t / 1e12:6.1f} "
                f"| {t_torch * 1e6:9.1f} | {dense_bytes / t_torch / 1e9:8.1f} | {flops / t_torch / 1e12:6.1f} "
                f"| {t_torch / t:5.2f}x |"
            )


def sweep_quant_decode(copy_bw: float) -> None:
    """A few decode (M=1) configs of each kernel at the first N x K, to tune `choose_config`."""
    n, k = QUANT_NK[0]
    emit(f"## quantized matmul decode config sweep (M=1, {n} x {k}, bf16; the first row is the default)")
    emit()
    emit("| kernel | config | µs | weight GB/s | of copy BW |")
    emit("|---|---|---:|---:|---:|")
    bk_big = 64 if DRY else 256
    sweep = [
        QuantMatmulConfig(16, 32, 128, 1, 4, 4),
        QuantMatmulConfig(16, 32, 128, 4, 4, 4),
        QuantMatmulConfig(16, 64, 128, 2, 4, 4),
        QuantMatmulConfig(16, 64, 128, 8, 4, 4),
        QuantMatmulConfig(16, 128, 128, 8, 4, 3),
        QuantMatmulConfig(16, 64, bk_big, 4, 4, 3),
        QuantMatmulConfig(16, 32, bk_big, 4, 4, 3),
        QuantMatmulConfig(16, 64, 64, 8, 2, 4),
    ]
    if DRY:
        sweep = [QuantMatmulConfig(16, 16, 32, 2, 4, 2), QuantMatmulConfig(16, 64, 64, 1, 4, 2)]
    x = torch.randn((1, k), device=DEVICE).to(torch.bfloat16)
    for label, bits, g, sd in (QUANT_KINDS[0], QUANT_KINDS[-1]):
        w = QuantWeight(bits, g, sd, n, k, seed=3)
        ref = w.matmul(x)
        for cfg in [_quant_config(1, w), *sweep]:
            if elapsed() > ARGS.budget_s:
                emit(f"| {label} | {_cfg_text(cfg)} | skipped: over the {ARGS.budget_s:.0f} s budget | | |")
                break
            out = torch.empty_like(ref)
            t = median_seconds(functools.partial(w.matmul, x, out=out, config=cfg))
            err = rel_err(out, ref.float())
            if err > TOLERANCE[torch.bfloat16]:
                FAILURES.append(f"sweep {label} {_cfg_text(cfg)}: differs from the default config by {err:.2e}")
            rate = w.bytes / t
            emit(f"| {label} | {_cfg_text(cfg)} | {t * 1e6:9.1f} | {rate / 1e9:8.1f} | {rate / copy_bw:6.1%} |")
    emit()


def time_attention_sections(copy_bw: float) -> None:
    """Sections 3 and 4: attention and write_kv timings, then the allocator kernels."""
    emit(
        f"## timings ({str(DTYPE).replace('torch.', '')}, {HEADS}q/{KV_HEADS}kv heads, head_dim {HEAD_DIM}); "
        f"device copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write of a {COPY_BYTES >> 20} MiB buffer)"
    )
    emit()
    emit(
        "| kernel | shape | block | splits | helexa µs | helexa | of copy BW | baseline µs "
        "| SDPA (gathered copy) | vs SDPA |"
    )
    emit("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    jobs = [("decode", n, s, bs) for n, s, bs in DECODE_SHAPES] + [("prefill", n, s, 16) for n, s in PREFILL_SHAPES]
    for kind, name, seqs, bs in jobs:
        if elapsed() > ARGS.budget_s:
            emit(f"| {kind} | {name} | {bs} | | skipped: over the {ARGS.budget_s:.0f} s budget | | | | | |")
            continue
        try:
            time_attention(kind, name, seqs, bs, copy_bw)
        except Exception as exc:
            FAILURES.append(f"{kind} {name}: {exc!r}")
            emit(f"| {kind} | {name} | {bs} | | ERROR {exc!r} | | | | | |")
        if not DRY:
            torch.cuda.empty_cache()
    for section in (time_write_kv, time_allocator):
        try:
            section(copy_bw) if section is time_write_kv else section()
        except Exception as exc:
            FAILURES.append(f"{section.__name__}: {exc!r}")
            emit(f"| {section.__name__} | ERROR {exc!r} | | | | | | | | |")
    emit()


def main() -> int:
    dev = "CPU (dry run, Triton interpreter)" if DRY else torch.cuda.get_device_name()
    emit(f"# helexa gpu_check — {dev}; torch {torch.__version__}, triton {triton.__version__}")
    emit()
    os.environ["HELEXA_DEBUG"] = "1"  # value checks on while verifying
    attention, quant = ARGS.only in ("all", "attention"), ARGS.only in ("all", "quant")
    for wanted, checks in ((attention, run_checks), (quant, run_quant_checks)):
        try:
            if wanted:
                checks()
        except Exception:
            FAILURES.append(f"{checks.__name__} raised")
            emit("```\n" + traceback.format_exc() + "```")
    emit(f"checks done at {elapsed():.0f} s: {len(FAILURES)} failure(s)")
    emit()
    os.environ["HELEXA_DEBUG"] = "0"  # no host syncs while timing

    copy_bw = copy_bandwidth()
    if attention:
        time_attention_sections(copy_bw)
    if quant:
        for quant_section in (dense_section, time_quant, sweep_quant_decode):
            try:
                quant_section(copy_bw)
            except Exception as exc:
                FAILURES.append(f"{quant_section.__name__}: {exc!r}")
                emit(f"{quant_section.__name__}: ERROR {exc!r}")
                emit("```\n" + traceback.format_exc() + "```")
    emit(f"finished in {elapsed():.0f} s; " + ("all checks passed" if not FAILURES else f"FAILURES: {FAILURES}"))
    out = Path(ARGS.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(LINES) + "\n")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
