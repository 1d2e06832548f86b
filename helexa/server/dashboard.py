"""The operator page: `GET /` serves a self-contained page (HTML, CSS and JS shipped in this package, no
network needed), and `GET /v1/dashboard` the JSON it polls.

The data route reads admission once (`AdmissionController.view`: the snapshot, the waiting and running
tickets and the recent rejections under one hold of its lock) and the pool once (`read_block_map`), and
reads both again (a few times at most) until the pool's block states are the snapshot's, so the totals,
the queue rows and the block map's colours agree with each other and with `GET /v1/admission`. It runs
in a worker thread, never on the event loop, and costs O(blocks) in mostly C-level copies.

The page's files hold no data, so they are served like a login page; the data route is under `/v1/`,
so with `--api-key` it needs `Authorization: Bearer KEY` (the page asks for the key and keeps it in the
browser's session storage). The data never holds prompt or output text: requests appear by id and session.
"""

from __future__ import annotations

import asyncio
import collections
import importlib.resources
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from helexa.admission import Ticket
from helexa.admission.rejections import RecentRejection
from helexa.engine.view import EngineView
from helexa.kvcache import HoldingView
from helexa.server.blockmap import BlockMap, read_block_map
from helexa.server.errors import ADMISSION_ERRORS
from helexa.server.tenancy import is_admin, redact_dashboard

if TYPE_CHECKING:
    from helexa.engine import ServingEngine

__all__ = ["DATA_PATH", "Dashboard", "History", "build_dashboard"]

DATA_PATH = "/v1/dashboard"
# path -> (file under static/, media type)
_ASSETS = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/dashboard/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
# Everything the page loads comes from this server: no CDN, and no way to send the key elsewhere.
_PAGE_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}
_CONSISTENT_READS = 5  # reads of admission + pool until they agree; then the last one is sent, marked inexact
_LARGE_POOL = 20_000  # blocks: beyond this the page polls once a second instead of twice


@dataclass(frozen=True)
class _Sample:
    at: float  # Unix seconds
    generation_tokens: int
    prompt_tokens: int
    steps: int
    step_seconds: float


class History:
    """The engine's counters sampled every `interval` seconds (the newest `keep` samples), for the sparklines.

    `start()` (on the event loop) begins sampling on a loop timer; `points()` is safe from any thread.
    Each point covers one interval: generated and prompt tokens per second, steps per second and the
    mean step time (None for an interval without steps). `clock`: Unix seconds (tests inject a fake).
    """

    def __init__(
        self, engine: ServingEngine, interval: float = 1.0, keep: int = 120, clock: Callable[[], float] = time.time
    ) -> None:
        self.engine, self.interval, self._clock = engine, interval, clock
        self._samples: collections.deque[_Sample] = collections.deque(maxlen=keep + 1)
        self._started = False

    def start(self) -> None:
        """Begin sampling on the running event loop (idempotent); it stops when the loop closes."""
        if self._started:
            return
        self._started = True
        self.sample()
        asyncio.get_running_loop().call_later(self.interval, self._tick)

    def _tick(self) -> None:
        self.sample()
        asyncio.get_running_loop().call_later(self.interval, self._tick)

    def sample(self) -> None:
        """Record the engine's counters now."""
        c = self.engine.counters
        self._samples.append(_Sample(self._clock(), c.generation_tokens, c.prompt_tokens, c.steps, c.step_seconds))

    def points(self) -> list[dict[str, float | None]]:
        """One point per interval between consecutive samples, oldest first."""
        samples = list(self._samples)
        out: list[dict[str, float | None]] = []
        for a, b in zip(samples, samples[1:]):
            dt = b.at - a.at
            if dt <= 0:
                continue
            steps = b.steps - a.steps
            out.append(
                {
                    "t": round(b.at, 3),
                    "generation_tps": round((b.generation_tokens - a.generation_tokens) / dt, 2),
                    "prompt_tps": round((b.prompt_tokens - a.prompt_tokens) / dt, 2),
                    "steps_per_s": round(steps / dt, 2),
                    "step_ms": round(1e3 * (b.step_seconds - a.step_seconds) / steps, 3) if steps else None,
                }
            )
        return out


def _request_id(ticket: Ticket) -> str:
    return ticket.request_id or f"ticket-{ticket.id}"


def _session(holding: HoldingView | None) -> str | None:
    session = holding.session if holding is not None else None
    return session if isinstance(session, str) else None


def _waiting_row(position: int, t: Ticket, now: float, holding: HoldingView | None) -> dict[str, Any]:
    return {
        "position": position,
        "id": _request_id(t),
        "session": _session(holding),
        "prompt_tokens": t.prompt_tokens,
        "max_tokens": t.max_tokens,
        "blocks_needed": t.blocks_reserved,
        "waited_s": round(max(0.0, now - t.arrival), 3),
        "est_start_s": round(max(0.0, t.est_start - now), 3),
        # preempted requests resume first and never expire
        "deadline_s": None if t.preemptions else round(t.deadline - now, 3),
        "preempted": t.preemptions,
    }


def _running_row(t: Ticket, now: float, holding: HoldingView | None) -> dict[str, Any]:
    held = len(holding.block_ids) if holding is not None else 0
    charged = holding.charged if holding is not None else 0
    return {
        "id": _request_id(t),
        "session": _session(holding),
        "prompt_tokens": t.prompt_tokens,
        "prompt_prefilled": t.prompt_prefilled,
        "tokens_generated": t.tokens_generated,
        "max_tokens": t.max_tokens,
        "blocks_charged": charged,  # blocks its reservation covers now (the KV owner's count)
        "blocks_reserved": t.blocks_reserved,
        "shared_blocks": held - charged,
        # blocks in its table, shared ones included (None: not started yet)
        "table_blocks": held if holding is not None and holding.running else None,
        "waited_s": round(t.waited_seconds or 0.0, 3),
        "running_s": round(max(0.0, now - (t.granted_at if t.granted_at is not None else now)), 3),
        "cancelling": t.cancel_requested,
    }


def _rejection_row(r: RecentRejection) -> dict[str, Any]:
    status, code, _ = ADMISSION_ERRORS[r.reason]
    return {
        "at": round(r.at, 3),
        "reason": r.reason,
        "status": status,
        "code": code,
        "retry_after": r.retry_after,
        "message": r.message,
        "arithmetic": r.line,
        "request_id": r.request_id,
    }


def _read(engine: ServingEngine) -> tuple[EngineView, BlockMap]:
    """The engine's view and its block map, read again (a few times at most) until the two agree."""
    for _ in range(_CONSISTENT_READS):
        view = engine.view()
        blocks = read_block_map(view)
        if blocks.exact:
            break
    return view, blocks


def build_dashboard(
    engine: ServingEngine, history: History | None = None, *, draining: bool = False, budget_line: str | None = None
) -> dict[str, Any]:
    """The data route's JSON: `admission` (the `GET /v1/admission` body), `blocks` (the block map, whose
    counts equal `expected_counts(admission)` when `blocks.exact`), `queue` (waiting requests in the order
    they will start, with estimated starts), `running`, `rejections` (newest first, with their arithmetic,
    HTTP status and Retry-After), `model` (name, device, dtype, budget, state and fault cause), `series`
    (the sparklines' points) and `poll_ms` (how often the page should ask again). No prompt text."""
    view, blocks = _read(engine)
    admission, now, holdings = view.snapshot, view.admission.now, view.holdings
    health, config = engine.health, engine.config
    budget_line = budget_line or view.budget_line
    return {
        "time": round(time.time(), 3),
        "admission": admission,
        "blocks": blocks.as_json(),
        "queue": [
            _waiting_row(i, t, now, holdings.get(t.request_id or "")) for i, t in enumerate(view.admission.waiting, 1)
        ],
        "running": [_running_row(t, now, holdings.get(t.request_id or "")) for t in view.admission.running],
        "rejections": [_rejection_row(r) for r in reversed(view.admission.rejections)],
        "model": {
            "name": engine.model_name,
            "device": str(engine.device),
            "dtype": str(engine.dtype).removeprefix("torch."),
            "kv_cache_dtype": config.kv_cache_dtype,
            "quantization": config.quantization,
            "attention_backend": config.attention_backend,
            "prefix_cache": config.prefix_cache,
            "max_model_len": engine.max_model_len,
            "budget": budget_line,
            "state": health.state,
            "fault_cause": health.fault_cause,
            "reload_seconds_left": health.reload_seconds_left(),
            "device_faults": engine.counters.device_faults,
            "model_reloads": engine.counters.model_reloads,
            "load_seconds": round(engine.load_seconds, 3),
            "draining": draining,
        },
        "series": {"interval_s": history.interval if history else None, "points": history.points() if history else []},
        "poll_ms": 1000 if admission["blocks_total"] > _LARGE_POOL else 500,
    }


class Dashboard:
    """The page's routes over one engine: its files (read from the package once) and the data route.

    `draining()` says whether the server is shutting down (shown on the page). With `admin_api_key`, only
    requests bearing it see request ids and session keys; others see pseudonyms (`tenancy.redact_dashboard`).
    """

    def __init__(self, engine: ServingEngine, draining: Any = lambda: False, admin_api_key: str | None = None) -> None:
        self.engine = engine
        self._admin_api_key = admin_api_key
        self.history = History(engine)
        self._draining = draining
        static = importlib.resources.files("helexa.server") / "static"
        self._assets = {path: (static.joinpath(name).read_bytes(), media) for path, (name, media) in _ASSETS.items()}
        self._budget_line = engine.view().budget_line  # kept across reloads

    def routes(self) -> list[Route]:
        """`GET /` (the page), its script and style sheet, and `GET /v1/dashboard` (its data)."""
        assets = [Route(path, self.asset, methods=["GET"]) for path in self._assets]
        return [*assets, Route(DATA_PATH, self.data, methods=["GET"])]

    async def asset(self, request: Request) -> Response:
        """One of the page's files, with a policy that lets it load nothing from anywhere else."""
        body, media = self._assets[request.url.path]
        return Response(body, media_type=media, headers=_PAGE_HEADERS)

    async def data(self, request: Request) -> Response:
        """`GET /v1/dashboard`: `build_dashboard`'s JSON, built in a worker thread."""
        self.history.start()
        body = await run_in_threadpool(
            build_dashboard, self.engine, self.history, draining=bool(self._draining()), budget_line=self._budget_line
        )
        if self._admin_api_key is not None and not is_admin(request.headers, self._admin_api_key):
            body = redact_dashboard(body)
        return JSONResponse(body, headers={"cache-control": "no-store"})
