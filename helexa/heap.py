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

`return_large_blocks` keeps a step's large buffers from staying resident once freed. glibc serves a block of
128 KiB or more from its own mapping and returns it at `free`, but each time such a block is freed it raises
that threshold to the block's size (up to 32 MiB): after the first long prefill, every later activation buffer
of a step (a piece's hidden states, the MLP's activations, its embeddings) comes from the heap, and the heap
keeps what fragmentation leaves behind. A fixed threshold of `LARGE_BLOCK_BYTES` (2 MiB) turns that adjustment
off: larger blocks are mapped and returned at `free`. Measured on a 2-vCPU EPYC (bench/RESULTS.md): with
this and the fused step's per-piece embeddings, a 1B model's peak over its resident set after load through
the peers benchmark went from 113 to 41 MiB, 16-stream decode unchanged within noise. At 1 MiB the default
model's 16-stream decode lost ~15% (its logits and the sampler's vocabulary-wide rows, 1.5-3 MiB a step,
were mapped and unmapped every step), so the threshold is 2 MiB.
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

__all__ = [
    "LARGE_BLOCK_BYTES",
    "freeze_heap",
    "release_free_pages",
    "resident_bytes",
    "return_large_blocks",
    "thaw_heap",
    "trim_heap",
]

LARGE_BLOCK_BYTES = 2 << 20  # `return_large_blocks`: from this size a block is mapped, and unmapped at free
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc malloc.h)


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
def _libc_function(name: str) -> Callable[..., int] | None:
    """glibc's function `name` (malloc_trim, mallopt), or None where the C library has none."""
    lib = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(lib), name) if lib else None
    except (OSError, AttributeError):  # not glibc
        return None


def release_free_pages() -> bool:
    """`malloc_trim(0)`, silently: the C heap's free pages go back to the OS. False where the C library has
    no malloc_trim. Walks the whole heap (milliseconds): call it after large frees, not per step."""
    trim = _libc_function("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True


def return_large_blocks() -> bool:
    """Make every C heap block of `LARGE_BLOCK_BYTES` or more its own mapping, unmapped when freed (glibc's
    `M_MMAP_THRESHOLD`; see the module doc): process-wide, idempotent. False where the C library has no
    mallopt or refused."""
    mallopt = _libc_function("mallopt")
    return mallopt is not None and mallopt(_M_MMAP_THRESHOLD, LARGE_BLOCK_BYTES) == 1


def trim_heap(who: str) -> int:
    """Return the C heap's free pages to the OS (glibc's `malloc_trim(0)`); log and return the resident bytes
    that gave back (0 where the C library has none: musl, macOS). Takes milliseconds; frees nothing in use."""
    before = resident_bytes()
    if not release_free_pages():
        return 0
    released = max(0, before - resident_bytes())
    logger.info("%s: %.1f MiB of freed heap handed back to the OS", who, released / 2**20)
    return released
