"""Which instruction set the native CPU kernels (`csrc/*.c`) are compiled for, chosen at run time.

The kernels' source is one; each path is that source compiled with its own target flags into its
own library, so code for an instruction set is only ever reached in the process whose CPU reported
it (never an illegal instruction: a library whose instructions the CPU lacks is never loaded).

- `avx2`: AVX2 + FMA + F16C (every x86-64 server since ~2013: EPYC, Xeon). Integer dot products by
  `vpmaddubsw` + `vpmaddwd` on 256-bit registers.
- `avx512_vnni`: AVX-512 F/BW/VL + VNNI (Ice Lake and later Xeons, Zen 4 and later EPYCs). The
  quantized GEMM's dot products by `vpdpbusd` on 512-bit registers (two chunks of 4 k per
  instruction); the rest of the step as on `avx2`.
- `avx512_amx`: `avx512_vnni` + AMX-TILE and AMX-INT8 (Sapphire Rapids and later Xeons). A quantized
  GEMM of 16 rows or more (prefill, large batches) takes each whole tile of 16 rows by AMX (one
  `tdpbsud`/`tdpbssd` per 16 rows x 16 columns x 32 k), the rest as `avx512_vnni`. Linux must grant the
  process the tile state (`arch_prctl`, Linux 5.16+); where it does not, the path is refused with the
  reason and the next one runs. Before a process uses it, a child process checks it against
  `avx512_vnni` on this CPU (`helexa.model.quant.pathcheck`): the same bits on random GEMMs, and, unless
  `HELEXA_CPU_KERNELS` names it, less time on a prefill-sized one; a path that fails is passed over
  with the reason (a fault ends the child, not the engine).

`candidates()` lists the paths the CPU reports (`/proc/cpuinfo` flags, which Linux clears for state
the OS does not save), best first, or the one `HELEXA_CPU_KERNELS` names (`auto`, the default, or a
path name; a path the CPU lacks is refused with the reason, never run); `native` loads the first that
builds. Within a path a row's result
never depends on the batch (csrc/step.c). Across today's paths the integer dot products are exact and
the float operations per column the same, so they agree bit for bit (tested), but only results within
one path are promised: a later path may sum in another order.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ENV", "PATHS", "KernelPath", "candidates", "cpu_flags", "missing"]

ENV = "HELEXA_CPU_KERNELS"


@dataclass(frozen=True)
class KernelPath:
    """One compiled variant of the kernels: its name, the compiler's target flags, and the
    `/proc/cpuinfo` flags a CPU must report to run it."""

    name: str
    compile_flags: tuple[str, ...]
    cpu_flags: frozenset[str]
    # the path this one must match bit for bit on this CPU (and, chosen automatically, beat on a prefill GEMM)
    # before a process uses it: `helexa.model.quant.pathcheck`
    checked_against: str | None = None


_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")
_AMX = ("-mamx-tile", "-mamx-int8")
_VNNI_FLAGS = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"})

# best last
PATHS: dict[str, KernelPath] = {
    p.name: p
    for p in (
        KernelPath("avx2", _AVX2, frozenset({"avx2", "fma", "f16c"})),
        KernelPath("avx512_vnni", _AVX2 + _AVX512, _VNNI_FLAGS),
        KernelPath(
            "avx512_amx", _AVX2 + _AVX512 + _AMX, _VNNI_FLAGS | {"amx_tile", "amx_int8"}, checked_against="avx512_vnni"
        ),
    )
}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The feature flags of this CPU as Linux reports them (empty when it cannot say)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def missing(path: KernelPath) -> list[str]:
    """The CPU flags `path` needs that this CPU does not report (sorted; empty when it runs here)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return [f"x86-64 (this is {platform.machine()})"]
    return sorted(path.cpu_flags - cpu_flags())


def candidates(want: str | None = None) -> tuple[list[KernelPath], str]:
    """(the paths this process may run, best first, "") or ([], why none), for `want` (default: the
    value of `HELEXA_CPU_KERNELS`, else "auto"): `auto` gives every path the CPU runs; a path's name
    gives that one alone, refused if the CPU lacks it. The caller takes the first that builds."""
    want = os.environ.get(ENV, "auto") if want is None else want
    if want != "auto":
        if want not in PATHS:
            return [], f"{ENV}={want!r} is not one of auto, {', '.join(PATHS)}"
        lacks = missing(PATHS[want])
        return ([], f"{ENV}={want} but the CPU lacks {lacks}") if lacks else ([PATHS[want]], "")
    runnable = [p for p in reversed(PATHS.values()) if not missing(p)]
    return (runnable, "") if runnable else ([], f"the CPU lacks {missing(PATHS['avx2'])}")
