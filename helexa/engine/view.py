"""The engine's read model: what the server shows an operator (`GET /v1/dashboard`, the page), in one typed value.

`Engine.view()` reads admission once (its tickets, counts and recent rejections under one hold of its
lock) and the KV owner once (where every block is and who holds it), so the server never reaches into
the engine's parts. The two readings are moments apart: `consistent` says whether the KV owner's
block states still equal admission's snapshot of them (the caller may read again when not).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from helexa.admission.controller import AdmissionView
from helexa.kvcache import HoldingView, KVSurvey

__all__ = ["EngineView"]


class EngineView(NamedTuple):
    """One reading for display. `admission`: admission's view; `snapshot`: the `GET /v1/admission` body of that
    same reading (with the engine's own fields); `kv`: the KV owner's survey (None while no pool is loaded: a
    reload); `holdings`: each request's blocks by request id; `budget_line`: the KV budget's arithmetic (None
    while reloading)."""

    admission: AdmissionView
    snapshot: dict[str, Any]
    kv: KVSurvey | None
    budget_line: str | None

    @property
    def holdings(self) -> dict[str, HoldingView]:
        return {h.key: h for h in self.kv.holdings} if self.kv is not None else {}

    @property
    def consistent(self) -> bool:
        """True when the survey's free, evictable and retained blocks are the snapshot's empty, cached and retained
        counts (always while reloading: there is no pool to disagree with)."""
        if self.kv is None:
            return True
        c, s = self.kv.cache, self.snapshot
        return (len(c.free), len(c.evictable), len(c.retained)) == (
            s["blocks_empty"],
            s["blocks_cached"],
            s["blocks_retained"],
        )
