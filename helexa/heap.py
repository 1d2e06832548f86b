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
were mapped and unmapped every step), so the threshold is 2 MiB. A block past it is still new pages, faulted
in as it is written, every time: the buffers a step needs every time (the fused step's logits and working
memory, the sampler's rows) are kept instead (`helexa.model.buffers`, and the C step's per-thread arenas).

`HeapLevel` is the steps' side of the same: blocks under that size still come from the heap, and an engine
checks after every step whether what they left behind has piled up (see there).
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
    "HEAP_SLACK_BYTES",
    "HEAP_TRIM_INTERVAL_SECS",
    "LARGE_BLOCK_BYTES",
    "HeapLevel",
    "freeze_heap",
    "release_free_pages",
    "resident_bytes",
    "return_large_blocks",
    "thaw_heap",
    "trim_heap",
]

LARGE_BLOCK_BYTES = 2 << 20  # `return_large_blocks`: from this size a block is mapped, and unmapped at free
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc malloc.h)
HEAP_SLACK_BYTES = 2 << 20  # `HeapLevel`: resident growth that sends the heap's free pages back
HEAP_TRIM_INTERVAL_SECS = 0.25  # `HeapLevel`: at most one trim in this long


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


_statm: tuple[int, int | None] = (-1, None)  # (pid, its /proc/self/statm descriptor): opened once per process


def resident_bytes() -> int:
    """This process's resident set now, in bytes (0 where /proc is not available): one `pread` of
    /proc/self/statm (~1.5 us), the file opened once per process (after a fork the child opens its own)."""
    global _statm
    pid, fd = _statm
    if pid != os.getpid():
        try:
            fd = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            fd = None
        _statm = (os.getpid(), fd)
    if fd is None:
        return 0
    try:
        return int(os.pread(fd, 128, 0).split()[1]) * _page_size()
    except (OSError, IndexError, ValueError):
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


class HeapLevel:
    """Keeps a serving loop's resident set from creeping up with heap that was freed but never handed back.

    Each step allocates and frees blocks under `LARGE_BLOCK_BYTES` (a sampler's vocabulary-wide rows, a
    prefill piece's projections, requests' own objects); glibc reuses them, but what fragmentation leaves
    between live blocks stays resident. Measured on the default model through the peers benchmark's runs,
    that grew the resident set 20 MiB over its level after load, nearly all of it free heap (malloc_trim
    took 11.1 of a 16-stream run's 11.8 MiB back). `check`, called once per step, reads the resident set
    (`resident_bytes`, ~1.5 us) and when it has grown `slack` bytes over its lowest level since the last
    trim, runs `release_free_pages` (milliseconds), so free heap never holds more than about `slack`
    resident for long. At most one trim runs per `interval` seconds: a step whose own working set in the
    heap is larger than `slack` would otherwise trim, and fault the pages back in, every step. On 2026-12-03
    a 2 MiB slack made 268 trims where 4 MiB made 15 (the steps' heap working set was 2-4 MiB). Since the
    steps keep their buffers, through the peers benchmark's runs on the default model 2 MiB made 6-13 trims
    where 4 MiB made 2-3, and the peak RSS's median over four runs each went from 551.6 to 547.1 MiB (0.5
    and 1.5 lower in the two alternating pairs). It frees nothing in use, and where /proc or malloc_trim is
    missing it does nothing.
    """

    def __init__(self, slack: int = HEAP_SLACK_BYTES, interval: float = HEAP_TRIM_INTERVAL_SECS) -> None:
        self.slack, self.interval = slack, interval
        self._last_trim = -float("inf")  # time.monotonic() of the last trim
        self.trims = 0  # how many times `check` handed pages back
        self.released = 0  # bytes those trims took off the resident set
        self._level = resident_bytes()

    def reset(self) -> None:
        """Take the resident set now as the level (after a load or reload, which trims on its own)."""
        self._level = resident_bytes()

    def check(self) -> bool:
        """Hand the heap's free pages back if the resident set grew `slack` bytes over its level; True when
        it did. The level follows the resident set down, and is set again after each trim."""
        now = resident_bytes()
        if now <= self._level or now == 0:
            self._level = now
            return False
        if now - self._level < self.slack or time.monotonic() - self._last_trim < self.interval:
            return False
        if not release_free_pages():
            return False
        self._last_trim = time.monotonic()
        after = resident_bytes()
        self.trims += 1
        self.released += max(0, now - after)
        self._level = after
        return True
