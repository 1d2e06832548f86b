"""Run a test on each instruction-set path of the native CPU kernels (`helexa.model.quant.isa`).

    @pytest.mark.parametrize("path", kernel_paths())
    def test_x(path, monkeypatch):
        use_kernel_path(path, monkeypatch)   # compiles it; skips, saying why, if this CPU lacks it

Every path is compiled on any machine with a compiler (so a path this CPU cannot run still has to
build); only the paths the CPU reports are run, each against the same reference. The `avx512_amx`
path's tiling also runs, with its tile operations emulated in C, wherever `avx512_vnni` does
(`use_emulated_amx`).
"""

from __future__ import annotations

import ctypes

import pytest

from helexa.model.quant import isa, native


def kernel_paths() -> list[str]:
    """The names of every path, best last."""
    return list(isa.PATHS)


def use_kernel_path(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the native kernels run on path `name` for this test (`HELEXA_CPU_KERNELS`), after
    compiling it; skip with the reason when this CPU cannot run it or no compiler builds it."""
    path = isa.PATHS[name]
    try:
        native.build(path)
    except RuntimeError as exc:
        pytest.skip(f"kernel path {name} does not build here: {exc}")
    lacks = isa.missing(path)
    if lacks:
        pytest.skip(f"kernel path {name}: compiled, not run (this CPU lacks {', '.join(lacks)})")
    monkeypatch.setenv(isa.ENV, name)
    if not native.available():
        pytest.skip(f"kernel path {name}: {native.unavailable_reason()}")
    assert native.kernel_path() == name


def require_native() -> None:
    """Skip, saying why, where helexa's native CPU kernels are unavailable (on the path this CPU picks)."""
    if not native.available():
        pytest.skip(f"helexa's CPU kernel is unavailable: {native.unavailable_reason()}")


def use_emulated_amx(monkeypatch: pytest.MonkeyPatch) -> ctypes.CDLL:
    """Make the native kernels run on the `avx512_amx` path's source built with its tile operations
    emulated in C (csrc/amx.h, HX_AMX_EMULATE) for this test, and return that library; skip, saying
    why, where the `avx512_vnni` path it builds on does not run."""
    use_kernel_path("avx512_vnni", monkeypatch)
    vnni = isa.PATHS["avx512_vnni"]
    emulated = isa.KernelPath("avx512_amx_emulated", (*vnni.compile_flags, "-DHX_AMX_EMULATE"), vnni.cpu_flags)
    lib, why = native.load_path(emulated)
    assert lib is not None, why
    lib.helexa_amx_emulated_products.restype = ctypes.c_int64
    monkeypatch.setattr(native, "_library", lambda: (lib, emulated.name, ""))
    return lib
