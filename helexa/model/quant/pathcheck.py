"""A kernel path checked against another on this CPU before a process uses it: the same bits, and, when it
was chosen automatically, less time on a prefill-sized GEMM.

The `avx512_amx` path is `avx512_vnni` with whole tiles of 16 rows taken by AMX; the two give the same bits by
construction (exact integer dot products, the same float operations per column), and helexa's tests check it
with the tile operations emulated. What no emulation shows is the hardware: a hypervisor that reports AMX but
faults on its first tile instruction, a tile operation read differently from the manual, or a CPU on which the
tiles' conversions cost more than they save. So before a process loads a checked path, `check()` runs this
file as a script in a child process, which loads both libraries, runs each on the same random inputs
(int4 with zero terms and int8, float16 and float32 scales, 35 rows: two whole tiles and three rows after)
and compares the outputs bit for bit; when asked (`timed`), it then times both on one prefill-sized int4
GEMM (`TIMED_SHAPE`). A fault ends the child, not the engine.

This file imports only the standard library (the child never imports torch), and
it reaches the libraries only through their exported C functions (`helexa_amx_enable`, `helexa_int4_gemm`,
`helexa_int8_gemm`), whose layouts are `helexa.model.quant.native`'s: per tile of 16 columns, the weight's
bytes (int4: K/2 bytes a column, int8: K) and its scales and zero terms (K/G values a column).
"""

from __future__ import annotations

import ctypes
import json
import random
import signal
import struct
import subprocess
import sys
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BIT_CASES", "TIMED_SHAPE", "PathCheck", "check"]

_GROUP = 32  # values per scale, as in GGUF's Q4_1 and Q8_0
# (weight kind, float16 scales) for the bit check: the default model's Q4_1 is int4 with float16 scales
BIT_CASES = (("int4", True), ("int4", False), ("int8", True), ("int8", False))
_BIT_SHAPE = (35, 256, 64)  # (M, K, N): two whole AMX tiles of rows and three rows after them
TIMED_SHAPE = (128, 2048, 2048)  # (M, K, N): a 128-token prefill's chunk of a 1B model's projection, int4
_TIMED_ROUNDS = 5  # each library's calls (alternating), the fastest taken
_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class PathCheck:
    """What `check()` found: `why` is "" when the candidate may be used, else the reason it may not (its
    outputs differ, it faulted, or it was slower). The times are None when nothing was timed."""

    why: str
    candidate_ms: float | None = None
    reference_ms: float | None = None

    @property
    def passed(self) -> bool:
        return not self.why


def check(
    candidate: Path,
    reference: Path,
    *,
    timed: bool,
    timed_shape: tuple[int, int, int] = TIMED_SHAPE,
    timeout_s: float = _TIMEOUT_S,
) -> PathCheck:
    """Runs the check in a child process (this interpreter, isolated mode) and says whether the library at
    `candidate` may be used in place of the one at `reference`: only if both give the same bits on every
    case of `BIT_CASES` and, with `timed`, the candidate's fastest of `_TIMED_ROUNDS` int4 GEMMs of
    `timed_shape` (M, K, N) takes less time than the reference's. Never raises for what the child does: a
    fault, an exit or a timeout is the reason in `why`."""
    argv = [sys.executable, "-I", str(Path(__file__).resolve()), str(candidate), str(reference)]
    if timed:
        argv += ["--timed", ",".join(map(str, timed_shape))]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return PathCheck(f"its check did not finish in {timeout_s:.0f} s")
    except OSError as exc:
        return PathCheck(f"its check could not start: {exc}")
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name if -done.returncode in signal.valid_signals() else "?"
        return PathCheck(f"its check process died of signal {-done.returncode} ({name}){_tail(done.stderr)}")
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return PathCheck(f"its check process exited with status {done.returncode}{_tail(done.stderr)}")
    try:
        found = json.loads(lines[-1])
    except ValueError:
        found = None
    if not isinstance(found, dict) or "error" not in found:
        return PathCheck(f"its check process printed no verdict: {lines[-1][-300:]!r}")
    if found["error"]:
        return PathCheck(found["error"])
    a, b = found.get("candidate_ms"), found.get("reference_ms")
    if a is not None and b is not None and a >= b:
        m, k, n = timed_shape
        why = f"slower here than the path it replaces: {a:.2f} ms against {b:.2f} ms for a {m} x {k} x {n} int4 GEMM"
        return PathCheck(why, a, b)
    return PathCheck("", a, b)


def _tail(stderr: str) -> str:
    last = [line for line in stderr.strip().splitlines() if line.strip()][-1:]
    return f": {last[0][-300:]}" if last else ""


# --- the child ---------------------------------------------------------------------------------------------


def _load(path: str) -> tuple[ctypes.CDLL, str]:
    """The library at `path` with its GEMMs' signatures set, granted the AMX tile state if it is an AMX build;
    "" or why it cannot run."""
    lib = ctypes.CDLL(path)
    lib.helexa_amx_enable.restype = ctypes.c_int
    rc = lib.helexa_amx_enable()  # 0 granted, 1 not an AMX build, -errno refused
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.helexa_int4_gemm.argtypes = [p, i64, i64, p, p, p, i64, i64, i64, p]
    lib.helexa_int8_gemm.argtypes = [p, i64, i64, p, p, i64, i64, i64, p]
    lib.helexa_int4_gemm.restype = lib.helexa_int8_gemm.restype = ctypes.c_int
    return lib, (f"Linux refused the AMX tile state (errno {-rc})" if rc < 0 else "")


class _Gemm:
    """Random inputs of one GEMM in the kernels' layouts, and the calls that run them: values like a real
    model's (activations ~N(0, 1), int8 weights in [-127, 127], scales ~0.01-0.03), never zeros."""

    def __init__(self, kind: str, half: bool, m: int, k: int, n: int, seed: int) -> None:
        rng = random.Random(seed)
        self.kind, self.half, self.m, self.k, self.n = kind, half, m, k, n
        self.x = array("f", (rng.gauss(0.0, 1.0) for _ in range(m * k)))
        if kind == "int4":
            self.q = rng.randbytes(n * k // 2)
        else:
            self.q = bytes((rng.randint(-127, 127) & 0xFF) for _ in range(n * k))
        groups = n * k // _GROUP
        fmt = "e" if half else "f"
        self.scales = struct.pack(f"{groups}{fmt}", *(rng.uniform(0.01, 0.03) for _ in range(groups)))
        self.zeros = struct.pack(f"{groups}{fmt}", *(rng.uniform(-0.2, 0.0) for _ in range(groups)))
        self.y = array("f", bytes(4 * m * n))

    def run(self, lib: ctypes.CDLL) -> bytes:
        """The output's bytes, poisoned (NaN) before the call; `RuntimeError` when the kernel refuses."""
        self.y[:] = array("f", [float("nan")]) * (self.m * self.n)
        x, y = self.x.buffer_info()[0], self.y.buffer_info()[0]
        if self.kind == "int4":
            args = (self.q, self.scales, self.zeros, int(self.half), self.n, _GROUP, y)
            rc = lib.helexa_int4_gemm(x, self.m, self.k, *args)
        else:
            rc = lib.helexa_int8_gemm(x, self.m, self.k, self.q, self.scales, int(self.half), self.n, _GROUP, y)
        if rc != 0:
            raise RuntimeError(f"the {self.kind} GEMM returned {rc}")
        return self.y.tobytes()


def _compare(candidate: ctypes.CDLL, reference: ctypes.CDLL) -> str:
    """ "" when both libraries give the same bits on every case, else the first difference."""
    m, k, n = _BIT_SHAPE
    for seed, (kind, half) in enumerate(BIT_CASES):
        gemm = _Gemm(kind, half, m, k, n, seed)
        want, got = gemm.run(reference), gemm.run(candidate)
        if any(v != v or abs(v) == float("inf") for v in array("f", want)):  # the poison left, or an overflow
            return f"the path it replaces gave values that are not finite on a {m} x {k} x {n} {kind} GEMM"
        if got != want:
            a, b = array("f", got), array("f", want)
            bad = [i for i in range(len(a)) if a[i].hex() != b[i].hex()]
            row, col = divmod(bad[0], n)
            return (
                f"its outputs differ from the path it replaces: {len(bad)} of {len(a)} values of a {m} x {k} x {n} "
                f"{kind} GEMM ({'float16' if half else 'float32'} scales), first at row {row} column {col}: "
                f"{a[bad[0]]!r} against {b[bad[0]]!r}"
            )
    return ""


def _time(candidate: ctypes.CDLL, reference: ctypes.CDLL, shape: tuple[int, int, int]) -> tuple[float, float]:
    """(candidate's, reference's) fastest int4 GEMM of `shape` in ms, calls alternating, after one warm-up each."""
    gemm = _Gemm("int4", True, *shape, seed=len(BIT_CASES))
    best = {id(candidate): float("inf"), id(reference): float("inf")}
    for r in range(_TIMED_ROUNDS + 1):
        for lib in (reference, candidate):
            start = time.perf_counter()
            gemm.run(lib)
            if r:  # the first round warms caches, pages and the thread team
                best[id(lib)] = min(best[id(lib)], (time.perf_counter() - start) * 1e3)
    return best[id(candidate)], best[id(reference)]


def main(argv: list[str]) -> int:
    """The child: `pathcheck.py CANDIDATE REFERENCE [--timed M,K,N]`. Prints one JSON line: "error" ("" when
    the bits agree) and, when timed, both times in ms."""
    candidate_path, reference_path = argv[0], argv[1]
    candidate, why = _load(candidate_path)
    reference, why_ref = _load(reference_path)
    out: dict[str, object] = {"error": why or why_ref or _compare(candidate, reference)}
    if not out["error"] and "--timed" in argv:
        m, k, n = (int(v) for v in argv[argv.index("--timed") + 1].split(","))
        out["candidate_ms"], out["reference_ms"] = _time(candidate, reference, (m, k, n))
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
