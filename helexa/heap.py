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
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger("helexa.heap")

__all__ = ["freeze_heap", "thaw_heap"]


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
