"""The serving processes' Python heap: frozen after load, so the cyclic collector never pauses a step or a reply.

A loaded server holds a few hundred thousand long-lived objects (torch, the tokenizer, the app, the model's
modules). Python's collector walks every tracked object in its oldest generation each time that generation
fills up: measured on the default model, 80-130 ms with the GIL held, on the server's event loop (a `/health`
answer, every stream's next chunk) or in the middle of a step. `freeze_heap` moves what is alive after load
out of the collector's sight (`gc.freeze`, as CPython documents for pre-fork servers and vLLM does after
start-up): later collections walk only what came after, milliseconds. Reference counting still frees
everything; only cyclic garbage among the frozen objects would wait, so `thaw_heap` gives them back before a
reload drops a model (its device memory must be returned), and the reload ends with `freeze_heap` again.

Only long-running server processes freeze (`python -m helexa.server` and its engine core); `LLM` leaves the
heap of the program that imports it alone.

`trim_heap` is the C heap's side, run by every engine after it loads: what loading allocated and freed (the
tokenizer's construction, conversion buffers) stays resident in glibc's heap until `malloc_trim` hands its free
pages back to the OS (12-15 MiB on the default model).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging
import os
import time
from collections.abc import Callable

logger = logging.getLogger("helexa.heap")

__all__ = ["freeze_heap", "resident_bytes", "thaw_heap", "trim_heap"]


def freeze_heap(who: str) -> int:
    """Collect the garbage of loading, then freeze every object alive now (`gc.freeze`); log and return how
    many objects the collector will no longer walk. `who` names the process in the log line."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info(
        "%s: heap frozen after load: %d objects out of the collector's walks (%.0f ms)",
        who,
        frozen,
        (time.perf_counter() - started) * 1e3,
    )
    return frozen


def thaw_heap() -> int:
    """Give the frozen objects back to the collector and collect everything: after it, no cyclic garbage of
    any age remains (a dropped model's tensors are freed). Returns how many objects were frozen (0: none, the
    heap was never frozen or is thawed already). Costs one full collection (~0.1 s)."""
    frozen = gc.get_freeze_count()
    gc.unfreeze()
    gc.collect()
    return frozen


def resident_bytes() -> int:
    """This process's resident set now, in bytes (0 where /proc is not available)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _page_size()
    except OSError:
        return 0


@functools.cache
def _page_size() -> int:
    return os.sysconf("SC_PAGE_SIZE")


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc: no malloc_trim
        return None


def trim_heap(who: str) -> int:
    """Return the C heap's free pages to the OS (glibc's `malloc_trim(0)`); log and return the resident bytes
    that gave back (0 where the C library has none: musl, macOS). Takes milliseconds; frees nothing in use."""
    trim = _malloc_trim()
    if trim is None:
        return 0
    before = resident_bytes()
    trim(0)
    released = max(0, before - resident_bytes())
    logger.info("%s: %.1f MiB of freed heap handed back to the OS", who, released / 2**20)
    return released
