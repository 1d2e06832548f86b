"""A kernel path checked against another before a process uses it (`helexa.model.quant.pathcheck`): the real
kernels against themselves, stand-in libraries that differ, fault, are refused the tile state or run slower,
the wiring that passes a checked path over, and, where `avx512_vnni` runs, the `avx512_amx` source with its
tile operations emulated checked against it."""

from __future__ import annotations

from pathlib import Path

import pytest

from helexa import cbuild
from helexa.model.quant import isa, native, pathcheck

# A stand-in for a kernel library: the two GEMMs the check calls, computing something simple and the same in
# every build, unless a mode below makes this build differ.
_STAND_IN = r"""
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>

int helexa_amx_enable(void) {
#ifdef CHATTY
    printf("a library that prints, then ends its process\n");
    fflush(stdout);
    _exit(0);
#endif
#ifdef REFUSED
    return -1; /* -EPERM */
#else
    return 1;
#endif
}

static int fill(const float *x, int64_t M, int64_t K, int64_t N, float *y) {
#ifdef FAULT
    raise(SIGILL);
#endif
#ifdef SLOW
    struct timespec pause = {0, 20 * 1000 * 1000};
    nanosleep(&pause, 0);
#endif
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) y[m * N + n] = x[m * K + n % K] * 0.5f;
#ifdef WRONG
    y[3 * N + 17] += 1.0f;
#endif
    return 0;
}

int helexa_int4_gemm(const float *x, int64_t M, int64_t K, const void *q, const void *s, const void *z, int64_t half,
                     int64_t N, int64_t G, float *y) { return fill(x, M, K, N, y); }

int helexa_int8_gemm(const float *x, int64_t M, int64_t K, const void *q, const void *s, int64_t half, int64_t N,
                     int64_t G, float *y) { return fill(x, M, K, N, y); }
"""


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory):
    """`stand_in(mode)`: the stand-in library built with -D`mode` ("" for none)."""
    if cbuild.compiler() is None:
        pytest.skip("no C compiler (cc or $CC) to build the stand-in libraries")
    root = tmp_path_factory.mktemp("stand_in")
    source = root / "stand_in.c"
    source.write_text(_STAND_IN)

    def build(mode: str = "") -> Path:
        flags = ["-O1", "-fPIC", "-shared", *([f"-D{mode}"] if mode else [])]
        return cbuild.compile_library(f"stand_in_{mode or 'plain'}", [source], flags, out_dir=root)

    return build


def _avx2_library() -> Path:
    path = isa.PATHS["avx2"]
    if isa.missing(path):
        pytest.skip(f"this CPU lacks {isa.missing(path)}: the avx2 kernels do not run here")
    try:
        return native.build(path)
    except RuntimeError as exc:
        pytest.skip(f"the avx2 kernels do not build here: {exc}")


def test_the_real_kernels_give_their_own_bits_and_are_timed() -> None:
    """The check's random inputs in the kernels' layouts run through the real GEMMs (int4 and int8, both scale
    widths, 35 rows) and come back finite and equal; timed, both libraries' times are measured."""
    lib = _avx2_library()
    found = pathcheck.check(lib, lib, timed=False)
    assert found.passed, found.why
    assert found.candidate_ms is None and found.reference_ms is None
    found = pathcheck.check(lib, lib, timed=True, timed_shape=(32, 256, 64))
    assert found.candidate_ms is not None and found.reference_ms is not None
    assert 0 < found.candidate_ms < 1e4 and 0 < found.reference_ms < 1e4
    assert found.passed or found.why.startswith("slower here"), found.why  # a library against itself: a coin


def test_a_path_whose_bits_differ_is_refused_with_where(stand_in) -> None:
    found = pathcheck.check(stand_in("WRONG"), stand_in(), timed=False)
    assert not found.passed
    assert found.why.startswith(
        "its outputs differ from the path it replaces: 1 of 2240 values of a 35 x 256 x 64 int4 GEMM"
    )
    assert "first at row 3 column 17" in found.why
    assert pathcheck.check(stand_in(), stand_in(), timed=False).passed  # the same build: no difference


def test_a_path_that_faults_ends_the_child_not_this_process(stand_in) -> None:
    found = pathcheck.check(stand_in("FAULT"), stand_in(), timed=False)
    assert found.why.startswith("its check process died of signal 4 (SIGILL)"), found.why


def test_a_path_refused_the_tile_state_is_refused(stand_in) -> None:
    found = pathcheck.check(stand_in("REFUSED"), stand_in(), timed=False)
    assert found.why == "Linux refused the AMX tile state (errno 1)"


def test_a_child_that_ends_without_a_verdict_is_a_refusal_not_an_error(stand_in) -> None:
    found = pathcheck.check(stand_in("CHATTY"), stand_in(), timed=False)
    assert found.why == "its check process printed no verdict: 'a library that prints, then ends its process'"


def test_timed_the_slower_path_is_refused_and_the_faster_passes(stand_in) -> None:
    """A 20 ms pause a call makes the slower library unmistakable; untimed, the same pair passes."""
    slower = pathcheck.check(stand_in("SLOW"), stand_in(), timed=True, timed_shape=(16, 64, 32))
    assert slower.why.startswith("slower here than the path it replaces:"), slower.why
    assert slower.why.endswith("for a 16 x 64 x 32 int4 GEMM")
    assert slower.candidate_ms >= 20 > slower.reference_ms
    faster = pathcheck.check(stand_in(), stand_in("SLOW"), timed=True, timed_shape=(16, 64, 32))
    assert faster.passed, faster.why
    assert faster.candidate_ms < 20 <= faster.reference_ms
    assert pathcheck.check(stand_in("SLOW"), stand_in(), timed=False).passed


def test_a_checked_path_that_fails_is_passed_over_for_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    """`native`'s choice: a path with `checked_against` runs the check (timed when chosen automatically, not
    when named) before it loads; one that fails is passed over, with the reason kept and logged, and the next
    path runs."""
    _avx2_library()
    monkeypatch.delenv("HELEXA_CPU_QUANT_KERNEL", raising=False)
    monkeypatch.delenv(isa.ENV, raising=False)
    native.kernel_path()  # this process's own choice resolved (and cached) before `isa.candidates` is replaced
    avx2 = isa.PATHS["avx2"]
    asked: list[tuple[str, str, bool]] = []

    def refuse(candidate: Path, reference: Path, *, timed: bool) -> pathcheck.PathCheck:
        asked.append((Path(candidate).name, Path(reference).name, timed))
        return pathcheck.PathCheck("its outputs differ from the path it replaces: (a stand-in answer)")

    name = "checked_stand_in"  # one build (the library's name is the path's); `_load` keys on (name, timed)
    checked = isa.KernelPath(name, avx2.compile_flags, avx2.cpu_flags, checked_against="avx2")
    monkeypatch.setitem(isa.PATHS, name, checked)
    for want, timed in (("auto", True), (name, False)):
        monkeypatch.setattr(native, "_passed_over", {})
        monkeypatch.setattr(native.pathcheck, "check", refuse)
        monkeypatch.setattr(isa, "candidates", lambda want=None: ([checked, avx2], ""))
        lib, chosen, why = native._resolve.__wrapped__("auto", want)
        assert (chosen, why) == ("avx2", "") and lib is not None
        reason = "its outputs differ from the path it replaces: (a stand-in answer)"
        assert native._passed_over == {("auto", want): {name: reason}}
        assert asked[-1][2] is timed
        assert asked[-1][0].startswith(f"wq_gemm-{name}-") and asked[-1][1].startswith("wq_gemm-avx2-")
        # what the load line and the benchmarks print, under the settings that chose so
        monkeypatch.setenv(isa.ENV, want)
        assert native.describe_path().endswith(f"({name} passed over: {reason})")
        monkeypatch.delenv(isa.ENV)


def test_the_emulated_amx_path_matches_avx512_vnni_and_loses_on_time() -> None:
    """The `avx512_amx` source with its tile operations emulated in C (csrc/amx.h) against `avx512_vnni`, the
    check the real path gets on an AMX CPU: the same bits; timed, the emulation (scalar loops) is refused as
    slower, which is the rule that keeps a real AMX path that does not win off."""
    vnni = isa.PATHS["avx512_vnni"]
    if isa.missing(vnni):
        pytest.skip(f"this CPU lacks {isa.missing(vnni)}: avx512_vnni, the emulation's base, does not run here")
    emulated = isa.KernelPath("avx512_amx_emulated", (*vnni.compile_flags, "-DHX_AMX_EMULATE"), vnni.cpu_flags)
    candidate, reference = native.build(emulated), native.build(vnni)
    assert pathcheck.check(candidate, reference, timed=False).passed
    found = pathcheck.check(candidate, reference, timed=True, timed_shape=(32, 512, 128))
    assert found.why.startswith("slower here than the path it replaces:"), found.why
