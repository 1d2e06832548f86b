"""helexa's own CPU kernel for quantized weights (`csrc/wq_gemm.c`), compiled on first use.

torch's packed CPU kernels are matrix-vector products per activation row in bfloat16: 16 decoding
streams cost 16 passes over the weight and 16x the float work. `wq_gemm.c` quantizes the activations
per 32-value block to int8 (llama.cpp's scheme: `quantize_activations` is its torch reference), takes
integer dot products (AVX2, AVX-512 VNNI, AMX tiles) over a weight tiled 16 output columns at a time (`tile_int4`,
`tile_int8`, done once when a layer is prepared), and decodes each weight chunk once per tile of up to
4 rows.
The result is `quantize_activations(x) @ W.T` of the exact dequantised weight, up to float32
summation order.

It is built with the machine's C compiler (`cc`, or `$CC`) into `$HELEXA_HOME/build/` (keyed by the
source and flags, so a changed source rebuilds) the first time a process asks for it, once per
instruction-set path (`helexa.model.quant.isa`: AVX2, AVX-512 VNNI, AMX), and the path this CPU runs is
loaded with ctypes (`kernel_path()` names it); calls release the GIL and run on torch's OpenMP
threads. It needs an x86-64 CPU with at least AVX2, FMA and F16C; elsewhere, or when no compiler
works, `available()` is False with the reason in `unavailable_reason()`, and callers use torch's
kernels.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import subprocess
from pathlib import Path

import torch

from helexa import cbuild
from helexa.model.quant import hugepages, isa, pathcheck
from helexa.model.quant.weight import QuantizedWeight
from helexa.model.weights.pull import helexa_home

__all__ = [
    "argmax_rows",
    "draw_rows",
    "logprobs_rows",
    "sort_rows",
    "top_rows",
    "available",
    "build",
    "dequantize_rows",
    "describe_path",
    "int4_gemm",
    "int8_gemm",
    "kernel_path",
    "library",
    "load_path",
    "passed_over",
    "quantize_activations",
    "supports",
    "tile_int4",
    "tile_int8",
    "unavailable_reason",
    "untile",
]

_log = logging.getLogger("helexa.quant")
CSRC = Path(__file__).with_name("csrc")  # the library's sources
_SOURCES = ("wq_gemm.c", "step.c")  # one library; its headers (csrc/*.h) are shared by both
# -ffp-contract=off: no fused multiply-add the source does not write, so every row is computed by the
# same operations wherever it is (the fused step's batch invariance, csrc/step.c). -Bsymbolic: each
# path's library calls its own functions, whichever other path's library the process also loaded.
_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared", "-Wl,-Bsymbolic"]
_LIBS = ["-lm"]
_BLOCK = 32  # activation values per int8 block; K and G must be multiples
_COLUMNS = 16  # output columns per tile of the weight layout (csrc/wq_gemm.c's NR); N must be a multiple
_TILE_ROWS = 1024  # rows tiled at a time (a multiple of _COLUMNS): bounds tiling's temporary memory


def build(path: isa.KernelPath, compiler: str | None = None, csrc: Path = CSRC) -> Path:
    """The compiled library of one instruction-set path, compiling it if this source and these flags
    have not been built yet (`helexa.cbuild`). Compiling needs no CPU support for the path (running it
    does); `RuntimeError` with the compiler's message when it fails. `csrc`: where the sources are
    (another tree's, for a benchmark against them; built with this module's flags)."""
    flags = [*_FLAGS, *path.compile_flags]
    sources = [csrc / name for name in _SOURCES]
    library = cbuild.compile_library(
        f"wq_gemm-{path.name}",
        sources,
        flags,
        _LIBS,
        out_dir=helexa_home() / "build",
        headers=sorted(csrc.glob("*.h")),
        compiler_path=compiler,
    )
    _log.debug("quant: the CPU kernel %s", library)
    return library


@functools.cache
def _load(name: str, timed: bool) -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library of path `name`, "") or (None, why not). Only called for a path the CPU runs."""
    return load_path(isa.PATHS[name], timed=timed)


def load_path(path: isa.KernelPath, csrc: Path = CSRC, *, timed: bool = False) -> tuple[ctypes.CDLL | None, str]:
    """(path's library, built from `csrc` and loaded with its functions' signatures set, "") or (None, why
    not). An AMX path asks Linux for the tile state first and is refused, with the reason, where Linux says
    no. A path with `checked_against` is refused, with the reason, unless `pathcheck.check` (a child
    process) finds it gives that path's bits on this CPU and, with `timed` (a path chosen automatically;
    not a benchmark's or a test's own choice), is faster; no GEMM of it runs in this process before that.
    Run it only on a CPU that reports `path.cpu_flags` (`isa.missing`)."""
    try:
        built = build(path, csrc=csrc)
        reference = build(isa.PATHS[path.checked_against], csrc=csrc) if path.checked_against else None
        lib = ctypes.CDLL(str(built))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, f"building it failed: {exc}"
    # Every library answers: 0 an AMX build now granted the tile state, 1 a build without AMX, -errno refused.
    lib.helexa_amx_enable.restype = ctypes.c_int
    rc = lib.helexa_amx_enable()
    if rc < 0 or (rc == 1 and "amx_tile" in path.cpu_flags):
        why = os.strerror(-rc) if rc < 0 else "not asked: the library was built without AMX"
        if rc == -errno.ENOSPC:  # Linux checks every thread's sigaltstack against AMX's larger signal frame
            why += ": a thread's alternate signal stack is too small for AMX's signal frame"
        return None, f"Linux did not grant the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: {why})"
    if reference is not None:
        found = pathcheck.check(built, reference, timed=timed)
        if not found.passed:
            return None, found.why
        if found.candidate_ms is not None:
            _log.info(
                "quant: the CPU kernel path %s checked against %s: the same bits; %.2f ms against %.2f ms on a "
                "prefill GEMM",
                path.name,
                path.checked_against,
                found.candidate_ms,
                found.reference_ms,
            )
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.helexa_int4_gemm.argtypes = [p, i64, i64, p, p, p, i64, i64, i64, p]
    lib.helexa_int8_gemm.argtypes = [p, i64, i64, p, p, i64, i64, i64, p]
    lib.helexa_int4_gemm.restype = lib.helexa_int8_gemm.restype = ctypes.c_int
    lib.helexa_set_threads.argtypes = [i64]
    lib.helexa_set_threads.restype = None
    lib.helexa_threads.restype = ctypes.c_int
    lib.helexa_paged_attention.argtypes = [p, p, p, *[i64] * 8, p, p, i64, p, ctypes.c_float, i64, p]
    lib.helexa_paged_attention.restype = ctypes.c_int
    lib.helexa_forward.argtypes = [p, i64, p, p, p, p, p, i64, p, p, i64, p, i64, p, p, i64, p, i64, i64, p]
    lib.helexa_forward.restype = ctypes.c_int
    lib.helexa_argmax_rows.argtypes = [p, i64, i64, i64, p]
    lib.helexa_argmax_rows.restype = None
    lib.helexa_logprobs_rows.argtypes = [p, i64, i64, i64, i64, p, p, p]
    lib.helexa_logprobs_rows.restype = ctypes.c_int
    lib.helexa_draw_rows.argtypes = [p, i64, i64, p, i64, p, p, p]
    lib.helexa_draw_rows.restype = ctypes.c_int
    lib.helexa_sort_rows.argtypes = [p, i64, i64, i64, p, p]
    lib.helexa_sort_rows.restype = ctypes.c_int
    lib.helexa_dequantize_rows.argtypes = [p, p, p, p, i64, i64, i64, i64, p, i64, p]
    lib.helexa_dequantize_rows.restype = ctypes.c_int
    return lib, ""


def _library() -> tuple[ctypes.CDLL | None, str, str]:
    """(the loaded library, its path's name, "") or (None, "", why not), for the environment now."""
    return _resolve(*_settings())


def _settings() -> tuple[str, str]:
    """The values of HELEXA_CPU_QUANT_KERNEL and HELEXA_CPU_KERNELS now ("auto" when unset)."""
    return os.environ.get("HELEXA_CPU_QUANT_KERNEL", "auto"), os.environ.get(isa.ENV, "auto")


@functools.cache
def _resolve(kernel: str, want: str) -> tuple[ctypes.CDLL | None, str, str]:
    """`_library()` for these values of HELEXA_CPU_QUANT_KERNEL and HELEXA_CPU_KERNELS: the first of
    `isa.candidates(want)` that builds (and passes its check: timed only when chosen automatically; a path
    named by HELEXA_CPU_KERNELS must give the same bits, not win). Each path passed over is logged and
    kept in `_passed_over[(kernel, want)]`."""
    if kernel == "torch":
        return None, "", "HELEXA_CPU_QUANT_KERNEL=torch"
    paths, why = isa.candidates(want)
    if not paths:
        return None, "", why
    if cbuild.compiler() is None:
        return None, "", "no C compiler (cc or $CC) to build it"
    passed = _passed_over.setdefault((kernel, want), {})
    for path in paths:
        lib, why = _load(path.name, want == "auto")
        if lib is not None:
            return lib, path.name, ""
        passed[path.name] = why
        _log.warning("quant: the CPU kernel path %s is passed over: %s", path.name, why)
    return None, "", why


# (HELEXA_CPU_QUANT_KERNEL, HELEXA_CPU_KERNELS) -> {path name: why `_resolve` passed it over for those values}
_passed_over: dict[tuple[str, str], dict[str, str]] = {}


def passed_over() -> dict[str, str]:
    """The paths this CPU reports that this process passed over for the environment now (their build, the OS
    or their check refused them), each with the reason: what a benchmark prints beside `kernel_path()`."""
    _library()
    return dict(_passed_over.get(_settings(), {}))


def describe_path() -> str:
    """`kernel_path()` with each path passed over and why, for a log line or a benchmark's table
    ("avx512_vnni (avx512_amx passed over: slower here than ...)")."""
    notes = "; ".join(f"{name} passed over: {why}" for name, why in passed_over().items())
    return f"{kernel_path()}{f' ({notes})' if notes else ''}"


def kernel_path() -> str:
    """The instruction-set path the native kernels run on in this process (a name of `isa.PATHS`), or
    "torch" when they are unavailable."""
    return _library()[1] or "torch"


def available() -> bool:
    """True when the kernel is built and loaded in this process (building it on the first call)."""
    return _library()[0] is not None


def unavailable_reason() -> str:
    """Why `available()` is False ("" when it is True)."""
    return _library()[2]


def _tile_values(q: torch.Tensor) -> torch.Tensor:
    """(N, K) values -> (N/16, K/4, 64): per tile of 16 columns and chunk of 4 k, value 4 * column + k."""
    n, k = q.shape
    return q.view(n // _COLUMNS, _COLUMNS, k // 4, 4).permute(0, 2, 1, 3).reshape(n // _COLUMNS, k // 4, 4 * _COLUMNS)


def _tile_groups(*ts: torch.Tensor) -> list[torch.Tensor]:
    """(N, groups) float32 each -> (N/16, groups, 16): the kernel's layout of scales and zero terms, in
    float16 when every value of every tensor is exactly a float16 (GGUF scales are), else float32; in
    `hugepages` memory, as the tiled bytes they are read with."""
    exact = all(torch.equal(t.float().half().float(), t.float()) for t in ts)
    dtype = torch.float16 if exact else torch.float32
    n, groups = ts[0].shape
    tiled = [hugepages.empty((n // _COLUMNS, groups, _COLUMNS), dtype) for _ in ts]  # streamed with the bytes
    for out, t in zip(tiled, ts):
        out.copy_(t.to(dtype).view(n // _COLUMNS, _COLUMNS, groups).transpose(1, 2))
    return tiled


def _dims(tiled: tuple[torch.Tensor, ...]) -> tuple[int, int]:
    """(N, K) of a weight tiled by `tile_int4` (3 tensors: K/8 pairs of chunks a tile) or `tile_int8`
    (2 tensors: K/4 chunks a tile)."""
    qt = tiled[0]
    return qt.shape[0] * _COLUMNS, qt.shape[1] * (8 if len(tiled) == 3 else 4)


def tile_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The canonical int4 weight (qweight (N, K/2) uint8, even k in the low nibble; scales, zeros
    (N, K/G)) in the kernel's tiled layout: (tiled bytes (N/16, K/8, 64), tiled scales, tiled zero
    terms z - 8 s), the last two float16 when that is exact, else float32. Byte j of a tile's pair of
    chunks holds value j (4 * column + k) of the first chunk in its low nibble and of the second in its
    high nibble. The tiled bytes lie on 2 MiB pages where Linux lends them (`hugepages`: the one-row
    GEMM streams them faster). Beside the result it allocates only what `_TILE_ROWS` rows need at a time."""
    n, half_k = qweight.shape
    tiled = hugepages.empty((n // _COLUMNS, half_k // 4, 4 * _COLUMNS), torch.uint8)
    for r in range(0, n, _TILE_ROWS):
        part = qweight[r : r + _TILE_ROWS]
        v = _tile_values(torch.stack((part & 0xF, part >> 4), dim=-1).flatten(1))  # (rows/16, K/4, 64) in [0, 15]
        tiled[r // _COLUMNS : (r + len(part)) // _COLUMNS] = v[:, 0::2] | (v[:, 1::2] << 4)
    s = scales.float()
    return tiled, *_tile_groups(s, zeros.float() - 8 * s)


def tile_int8(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The canonical int8 weight (qweight (N, K) int8; scales (N, K/G), or (N,) per channel) in the
    kernel's tiled layout: (tiled bytes (N/16, K/4, 64), tiled scales), the scales float16 when that
    is exact. Byte j of a tile's chunk is its value j (4 * column + k); the bytes on 2 MiB pages where
    Linux lends them, as `tile_int4`'s."""
    scales = scales if scales.dim() == 2 else scales[:, None]
    n, k = qweight.shape
    tiled = hugepages.empty((n // _COLUMNS, k // 4, 4 * _COLUMNS), torch.int8)
    for r in range(0, n, _TILE_ROWS):
        tiled[r // _COLUMNS : (r + _TILE_ROWS) // _COLUMNS] = _tile_values(qweight[r : r + _TILE_ROWS])
    return tiled, *_tile_groups(scales)


def untile(tiled: tuple[torch.Tensor, ...], rows: torch.Tensor | None = None) -> QuantizedWeight:
    """The canonical weight (`QuantizedWeight`) of a weight tiled by `tile_int4` or `tile_int8`, or of
    its rows `rows` (R,) int64 alone: the same quantized values; scales in the tiled dtype (float16
    where that was exact, so the same numbers); int4 zeros as zero terms + 8 * scales in float32 (the
    stored zeros whenever z - 8 s was exact, as for every GGUF Q4_0/Q4_1 block). Int8 per-channel
    scales come back as one group of K. Reads only the requested rows' bytes."""
    int4 = len(tiled) == 3
    qt, scales = tiled[0], tiled[1]
    tiles, chunks = qt.shape[0], qt.shape[1]  # int4: pairs of chunks
    n = tiles * _COLUMNS
    ids = torch.arange(n) if rows is None else rows.long()
    t, c = ids // _COLUMNS, ids % _COLUMNS
    r = len(ids)
    # Column c's 4 values of a chunk are bytes 4c..4c+3 of it (int4: of a pair of chunks, the first chunk's
    # in the low nibbles, the second's in the high). Only those bytes are gathered and unpacked (a
    # 256-row lookup held ~5 MiB of whole tiles).
    q = torch.gather(qt[t], 2, (4 * c[:, None, None] + torch.arange(4)).expand(r, chunks, 4))  # (R, chunks, 4)
    if int4:
        q = torch.stack((q & 0xF, q >> 4), dim=2)  # (R, K/8, 2, 4)
    q = q.reshape(r, -1)  # (R, K)
    s = scales[t, :, c]  # (R, groups)
    if not int4:
        return QuantizedWeight.of(q.contiguous(), s.contiguous())
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()  # even k in the low nibble
    zeros = tiled[2][t, :, c].float() + 8 * s.float()
    return QuantizedWeight.of(packed, s.contiguous(), zeros.contiguous())


def dequantize_rows(tiled: tuple[torch.Tensor, ...], ids: torch.Tensor) -> torch.Tensor:
    """The rows `ids` (R,) of a weight tiled by `tile_int4` or `tile_int8`, dequantised: (R, K) float32,
    bit for bit `untile(tiled, ids).dequantize(torch.float32)` (an embedding lookup), in one native call
    that reads only those rows' bytes. `IndexError` for an id outside [0, N)."""
    qt, scales = tiled[0], tiled[1]
    n, k = _dims(tiled)
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(ids.shape[0], k, dtype=torch.float32)
    zero_terms = tiled[2] if len(tiled) == 3 else None
    rc = library().helexa_dequantize_rows(
        qt.data_ptr() if zero_terms is not None else None, qt.data_ptr() if zero_terms is None else None,
        scales.data_ptr(), None if zero_terms is None else zero_terms.data_ptr(), scales.dtype == torch.float16,
        n, k, k // scales.shape[1], ids.data_ptr(), ids.shape[0], out.data_ptr(),
    )  # fmt: skip
    if rc == -3:
        bad = ids[(ids < 0) | (ids >= n)][0].item()
        raise IndexError(f"row {bad} is out of range for a weight of {n} rows")
    return out


def supports(n: int, k: int, group: int) -> bool:
    """True when the kernel takes a weight of this shape: N % 16 == 0, K and G multiples of 32."""
    return n % _COLUMNS == 0 and k % _BLOCK == 0 and group % _BLOCK == 0 and k % group == 0


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) float32 through the kernel's activation round trip: per row and 32-value block,
    d = max|x| / 127 and x_hat = d * round(x / d) (ties to even), all in float32. K % 32 == 0."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // _BLOCK, _BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127.0  # (M, K/32, 1)
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(blocks * inv) * d).reshape(m, k)


def library() -> ctypes.CDLL:
    """The loaded library of this process's path (for `helexa.model.quant.native_step`), set to run on
    as many threads as torch's intra-op pool (`torch.get_num_threads()`, read at each call: it may
    change, and the thread that calls may not be the one that set it); `RuntimeError` with the reason
    when it is unavailable."""
    lib, _, why = _library()
    if lib is None:
        raise RuntimeError(f"helexa's CPU quant kernel is unavailable: {why}")
    threads = torch.get_num_threads()
    if threads != _threads_set.get(id(lib)):
        lib.helexa_set_threads(threads)
        _threads_set[id(lib)] = threads
    return lib


_threads_set: dict[int, int] = {}  # per loaded library: what `library()` last passed to helexa_set_threads


def _run(
    name: str,
    x: torch.Tensor,
    n: int,
    k: int,
    tiled: torch.Tensor,
    scales: torch.Tensor,
    *extra: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    groups = scales.shape[1]
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or not x.is_contiguous() or x.is_cuda:
        raise ValueError(f"x must be a contiguous CPU float32 (M, {k}), got {x.dtype} {tuple(x.shape)}")
    if not supports(n, k, k // groups) or scales.shape != (n // _COLUMNS, groups, _COLUMNS):
        raise ValueError(f"not a tiled weight the kernel takes: N={n}, K={k}, scales {tuple(scales.shape)}")
    for t in (tiled, scales, *extra):
        if not t.is_contiguous():
            raise ValueError("tiled weights, scales and zero terms must be contiguous")
    if scales.dtype not in (torch.float32, torch.float16) or any(t.dtype != scales.dtype for t in extra):
        raise ValueError(f"scales and zero terms must be all float32 or all float16, got {scales.dtype}")
    if out is None:
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
    elif out.dtype != torch.float32 or out.shape != (x.shape[0], n) or not out.is_contiguous() or out.is_cuda:
        want = f"a contiguous CPU float32 ({x.shape[0]}, {n})"
        raise ValueError(f"out must be {want}, got {out.dtype} {tuple(out.shape)}")
    else:
        y = out
    pointers = [t.data_ptr() for t in (tiled, scales, *extra)]
    half = scales.dtype == torch.float16
    if getattr(library(), name)(x.data_ptr(), x.shape[0], k, *pointers, half, n, k // groups, y.data_ptr()):
        raise MemoryError(f"the quantized matmul could not allocate its activation buffer ({x.shape[0]} x {k})")
    return y


def int4_gemm(x: torch.Tensor, tiled: tuple[torch.Tensor, ...], out: torch.Tensor | None = None) -> torch.Tensor:
    """quantize_activations(x) @ W.T -> (M, N) float32 for x (M, K) contiguous float32 and W an int4
    weight tiled by `tile_int4`; written into `out` (contiguous float32 (M, N)) when given."""
    qt, scales, zero_terms = tiled
    if qt.dtype != torch.uint8 or zero_terms.shape != scales.shape:
        raise ValueError("an int4 weight is (uint8 tiles, scales, zero terms of the scales' shape)")
    n, k = _dims(tiled)
    return _run("helexa_int4_gemm", x, n, k, qt, scales, zero_terms, out=out)


def int8_gemm(x: torch.Tensor, tiled: tuple[torch.Tensor, ...], out: torch.Tensor | None = None) -> torch.Tensor:
    """quantize_activations(x) @ W.T -> (M, N) float32 for x (M, K) contiguous float32 and W an int8
    weight tiled by `tile_int8`; written into `out` (contiguous float32 (M, N)) when given."""
    qt, scales = tiled
    if qt.dtype != torch.int8:
        raise ValueError("an int8 weight is (int8 tiles, scales)")
    n, k = _dims(tiled)
    return _run("helexa_int8_gemm", x, n, k, qt, scales, out=out)


def _check_rows(x: torch.Tensor, name: str, max_cols: int | None = None) -> None:
    """The row kernels' one input rule: a CPU float32 (S, V) with 0 < V (<= `max_cols`) whose rows are
    contiguous (a slice of columns too); ValueError naming `name` otherwise."""
    cols = x.shape[-1] if x.dim() else 0
    if x.dtype != torch.float32 or x.dim() != 2 or x.is_cuda or x.stride(1) != 1 or not 0 < cols <= (max_cols or cols):
        bound = f"0 < V <= {max_cols}" if max_cols else "V > 0"
        raise ValueError(
            f"{name} takes a CPU float32 (S, {bound}) with contiguous rows, got {x.dtype} {tuple(x.shape)}"
        )


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` (S,) int64 for a CPU float32 x (S, V), V > 0, whose rows are contiguous (a
    slice of columns too): the same indices (the first of equal maxima; the first NaN where a row has
    one), from two vector passes over each row where torch's reduction walks it a value at a time."""
    _check_rows(x, "argmax_rows")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    library().helexa_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    return out


TOP_LOGPROBS_MAX = 64  # the most top tokens `logprobs_rows` returns per row (csrc/step.c's HX_TOP_MAX)


def _top_pass(
    x: torch.Tensor, k: int, name: str, with_sum: bool
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None] | None:
    """helexa_logprobs_rows over x: `(shift, ids, values)` (shift and values None without `with_sum`), or
    None where a row holds a NaN."""
    _check_rows(x, name)
    if not 0 <= k <= min(x.shape[1], TOP_LOGPROBS_MAX):
        raise ValueError(f"{name} takes 0 <= k <= {min(x.shape[1], TOP_LOGPROBS_MAX)}, got {k}")
    rows = x.shape[0]
    ids = torch.empty(rows, k, dtype=torch.int64)
    shift, values = (torch.empty(rows, 2), torch.empty(rows, k)) if with_sum else (None, None)
    rc = library().helexa_logprobs_rows(
        x.data_ptr(), rows, x.shape[1], x.stride(0), k, None if shift is None else shift.data_ptr(),
        ids.data_ptr(), None if values is None else values.data_ptr(),
    )  # fmt: skip
    if rc < 0:
        raise RuntimeError(f"helexa_logprobs_rows failed ({rc})")
    return None if rc else (shift, ids, values)


def logprobs_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The log-softmax of each row of a CPU float32 x (S, V), V > 0, rows contiguous (a slice of columns
    too), without writing it: `(shift, ids, values)` with `shift` (S, 2) each row's maximum and the log of its
    sum of exp(x - maximum), so that token t's log-probability is `(x[t] - shift[:, 0]) - shift[:, 1]`; `ids`
    (S, k) int64 the k largest values' columns, largest first, equal values by the lower column; `values`
    (S, k) their log-probabilities by that formula. Each row alone, the same on every kernel path, within
    float32 precision of torch's `log_softmax` (another exp). None where a row holds a NaN (the caller takes
    torch's path). `0 <= k <= min(V, TOP_LOGPROBS_MAX)`."""
    found = _top_pass(x, k, "logprobs_rows", with_sum=True)
    if found is None:
        return None
    shift, ids, values = found
    assert shift is not None and values is not None
    return shift, ids, values


def top_rows(x: torch.Tensor, k: int) -> torch.Tensor | None:
    """`logprobs_rows`' `ids` alone (its one pass, no sum): (S, k) int64, each row's k largest values' columns,
    largest first, equal values by the lower column. None where a row holds a NaN."""
    found = _top_pass(x, k, "top_rows", with_sum=False)
    return None if found is None else found[1]


DRAW_MAX_COLUMNS = 64 * 8192  # the widest row `draw_rows` takes (csrc/step.c's HX_DRAW_BLOCK x HX_DRAW_BLOCKS)


def draw_rows(x: torch.Tensor, which: list[int], temperature: list[float], u: torch.Tensor) -> torch.Tensor | None:
    """One token (len(which),) int64 for each row `which[i]` of a CPU float32 x (S, V), rows contiguous (a slice
    of columns too), at `temperature[i]` > 0 by the uniform `u[i]` in [0, 1) (float32): the first column whose
    running sum of exp(x / t - max) (in blocks of 64 columns, then the crossing block's columns in order)
    exceeds u times the row's total; never a column of weight 0. Each row alone, the same token on every
    kernel path. None where a row holds a NaN or has no finite maximum (the caller takes torch's path). V
    at most `DRAW_MAX_COLUMNS`."""
    _check_rows(x, "draw_rows", DRAW_MAX_COLUMNS)
    count = len(which)
    if len(temperature) != count or u.shape != (count,) or u.dtype != torch.float32 or u.is_cuda:
        raise ValueError(f"draw_rows needs one temperature and one float32 CPU draw per row: {count} rows")
    if any(not 0 <= i < x.shape[0] for i in which) or any(not t > 0 for t in temperature):
        raise ValueError("draw_rows takes rows of x and temperatures > 0")
    rows = torch.tensor(which, dtype=torch.int64)
    temps = torch.tensor(temperature, dtype=torch.float32)
    u = u.contiguous()
    out = torch.empty(count, dtype=torch.int64)
    rc = library().helexa_draw_rows(
        x.data_ptr(), x.shape[1], x.stride(0), rows.data_ptr(), count, temps.data_ptr(), u.data_ptr(), out.data_ptr()
    )
    if rc < 0:
        raise RuntimeError(f"helexa_draw_rows failed ({rc})")
    return None if rc else out


def sort_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`x.sort(dim=-1, descending=True, stable=True)` for a CPU float32 x (S, V), V > 0, rows contiguous (a slice
    of columns too): the same values and indices (equal values, -0.0 and +0.0 among them, in column order), by a
    radix sort (several times as fast as torch's stable sort over a 49k vocabulary). None where a row holds a
    NaN (the caller takes torch's sort)."""
    _check_rows(x, "sort_rows")
    values = torch.empty(x.shape)
    ids = torch.empty(x.shape, dtype=torch.int64)
    rc = library().helexa_sort_rows(
        x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), values.data_ptr(), ids.data_ptr()
    )
    if rc < 0:
        raise RuntimeError(f"helexa_sort_rows failed ({rc})")
    return None if rc else (values, ids)
