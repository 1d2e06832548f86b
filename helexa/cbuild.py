"""helexa's C sources compiled on the machine that runs them, once per source, compiler and flags.

    path = compile_library("ngram", [CSRC / "ngram.c"], ["-O2", "-fPIC", "-shared"], out_dir=home / "build")
    lib = ctypes.CDLL(str(path))

Callers put their libraries in `$HELEXA_HOME/build/` (`helexa.model.weights.pull.helexa_home`). The
library's file name carries a hash of its sources, the compiler and the flags, so a changed source (or
flag) builds a new library and an unchanged one is never rebuilt. A build writes into a temporary
directory beside the target and renames it into place, so processes building the same library at once
(test workers, a server and its engine core) each end with a complete file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["compile_library", "compiler"]

_log = logging.getLogger("helexa.cbuild")


def compiler() -> str | None:
    """The C compiler builds use: `$CC`, else `cc`, else `gcc` on the PATH; None when there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def compile_library(
    stem: str,
    sources: Sequence[Path],
    flags: Sequence[str],
    libs: Sequence[str] = (),
    *,
    out_dir: Path,
    headers: Sequence[Path] = (),
    compiler_path: str | None = None,
) -> Path:
    """The shared library `out_dir/<stem>-<hash>.so` built from `sources` with `flags` (and linked with
    `libs`), compiling it unless this exact build exists already. `headers` count towards the hash (a changed
    header rebuilds). `RuntimeError` without a compiler or with the compiler's message when it fails."""
    cc = compiler_path or compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc or $CC)")
    text = b"".join(p.read_bytes() for p in [*sources, *headers])
    key = hashlib.sha256(text + " ".join([cc, *flags, *libs]).encode()).hexdigest()[:16]
    target = out_dir / f"{stem}-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run(
            [cc, *flags, "-o", str(built), *map(str, sources), *libs], capture_output=True, text=True, timeout=120
        )
        if result.returncode != 0:
            raise RuntimeError(f"{cc} failed: {result.stderr.strip()[-500:]}")
        os.replace(built, target)  # atomic: a concurrent build of the same key writes the same bytes
    _log.info("built %s", target)
    return target
