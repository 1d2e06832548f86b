"""The Starlette app: OpenAI-compatible routes over a running `Engine`.

`create_app(engine, settings)` builds it. A generation request goes: parse and validate
(`protocol`) → render the chat template and tokenise (in a worker thread: templates and long
prompts are CPU work) → `GenerationRun.submit` (admission answers at once: granted, queued, or an
error with its status, code and Retry-After) → wait for the engine's events while watching for the
client leaving (which aborts the run) → shape the OpenAI response, or stream it as server-sent
events. A streaming request waits for its first event before answering, so a request that times
out in the admission queue still gets a proper 503 with Retry-After instead of a broken stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from helexa.engine import Engine, TokenEvent
from helexa.server.errors import APIError, error_response
from helexa.server.formats import FORMATS, ApiFormat, LogprobFormatter
from helexa.server.generation import Choice, GenerationRun, event_error
from helexa.server.metrics import CONTENT_TYPE, ServerMetrics
from helexa.server.middleware import AuthMiddleware, BodyLimitMiddleware, RequestContextMiddleware, request_id_of
from helexa.server.protocol import GenerationRequest, decode_json
from helexa.server.settings import ServerSettings
from helexa.server.sse import EventStreamResponse, sse, until_disconnected

__all__ = ["ServerState", "create_app"]

logger = logging.getLogger("helexa.server")


@dataclass
class ServerState:
    """What every route reads: the engine, the settings, the metrics, and whether the server is draining."""

    engine: Engine
    settings: ServerSettings
    metrics: ServerMetrics
    logprobs: LogprobFormatter
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False


def _state(request: Request) -> ServerState:
    return request.app.state.helexa


# --------------------------------------------------------------------------- from request to engine


def _prompt_ids(state: ServerState, req: GenerationRequest) -> list[list[int]]:
    """Token ids of each prompt: the rendered chat template, or the completion prompt (text or ids)."""
    tokenizer = state.engine.tokenizer
    if req.messages is not None:
        try:
            return [tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tools=req.tools)]
        except ValueError as exc:  # ChatTemplateError is a ValueError
            raise APIError(
                "invalid_request", f"chat template: {exc}", param="input" if req.kind == "response" else "messages"
            ) from None
    ids = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in req.prompts]
    if any(not p for p in ids):
        raise APIError("invalid_request", "the prompt is empty after tokenisation", param="prompt")
    return ids


async def _start(
    request: Request, parse: Callable[[dict[str, Any]], GenerationRequest], prefix: str
) -> tuple[ServerState, GenerationRequest, GenerationRun]:
    """Parse, tokenise and submit; raises `APIError` for every answer but a granted or queued run."""
    state = _state(request)
    if state.draining:
        raise APIError("shutting_down", "the server is shutting down and admits no new requests")
    req = parse(decode_json(await request.body()))
    prompt_ids = await run_in_threadpool(_prompt_ids, state, req)
    run = GenerationRun(state.engine, f"{prefix}{uuid.uuid4().hex}", prompt_ids, req)
    run.submit()
    return state, req, run


async def _race_disconnect(request: Request, work: asyncio.Future) -> bool:
    """Await `work` unless the client disconnects first (then `work` is cancelled); True if `work` finished."""
    watch = asyncio.ensure_future(until_disconnected(request.receive))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if work in done:
        return True
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await work
    return False


async def _collect(request: Request, run: GenerationRun) -> bool:
    """Run every choice to its end; False (and every choice aborted) when the client left first."""

    async def drain() -> None:
        async for _ in run.events():
            pass

    finished = await _race_disconnect(request, asyncio.ensure_future(drain()))
    if not finished:
        run.abort()
        logger.info(
            "request %s: client disconnected before completion; aborted %d choices",
            request_id_of(request.scope),
            len(run.handles),
        )
    return finished


def _raise_choice_error(run: GenerationRun) -> None:
    for choice in run.choices:
        error = event_error(TokenEvent(finish_reason=choice.finish_reason, error=choice.error))
        if error is not None:
            raise error


def _observe(state: ServerState, run: GenerationRun) -> None:
    for waited in run.admission_waits:
        state.metrics.observe_admission_wait(waited)
    if run.first_token_at is not None:
        state.metrics.observe_ttft(run.first_token_at - run.started)


async def _stream_start(
    request: Request, run: GenerationRun
) -> tuple[tuple[Choice, TokenEvent], AsyncGenerator[tuple[Choice, TokenEvent], None]] | None:
    """Wait for the run's first event (so admission errors become real HTTP errors); None if the client left."""
    events = run.events()
    first = asyncio.ensure_future(events.__anext__())
    if not await _race_disconnect(request, first):
        await events.aclose()
        run.abort()
        return None
    item = first.result()
    error = event_error(item[1])
    if error is not None:
        await events.aclose()
        raise error
    return item, events


async def _chain(
    first: tuple[Choice, TokenEvent], rest: AsyncIterator[tuple[Choice, TokenEvent]]
) -> AsyncIterator[tuple[Choice, TokenEvent]]:
    yield first
    async for item in rest:
        yield item


# --------------------------------------------------------------------------- the generation route


async def generate(request: Request) -> Response | EventStreamResponse:
    """`POST /v1/chat/completions`, `/v1/completions`, `/v1/responses`: one route, shaped by the path's format."""
    parse, fmt_type = FORMATS[request.url.path]
    state, req, run = await _start(request, parse, fmt_type.id_prefix)
    fmt = fmt_type(req, run, state.engine.model_name, state.logprobs)
    if req.stream:
        started = await _stream_start(request, run)
        if started is None:
            return Response(status_code=499)
        return EventStreamResponse(_stream(state, fmt, *started, request), run.abort)
    try:
        if not await _collect(request, run):
            return Response(status_code=499)
        _raise_choice_error(run)
        return JSONResponse(fmt.body())
    finally:
        _observe(state, run)


async def _stream(
    state: ServerState,
    fmt: ApiFormat,
    first: tuple[Choice, TokenEvent],
    events: AsyncGenerator[tuple[Choice, TokenEvent], None],
    request: Request,
) -> AsyncGenerator[bytes, None]:
    failed = False
    try:
        for chunk in fmt.start():
            yield chunk
        async for choice, event in _chain(first, events):
            error = event_error(event)
            if error is not None:
                logger.warning(
                    "request %s: stream ended with %s: %s", request_id_of(request.scope), error.code, error.message
                )
                yield sse(error.body())
                failed = True
                break
            for chunk in fmt.event(choice, event):
                yield chunk
        for chunk in fmt.end(failed):
            yield chunk
    finally:
        await events.aclose()
        _observe(state, fmt.run)


# --------------------------------------------------------------------------- the other routes


async def models(request: Request) -> Response:
    """`GET /v1/models`: the one model this server serves."""
    state = _state(request)
    engine = state.engine
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {
                    "id": engine.model_name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "helexa",
                    "max_model_len": engine.max_model_len,
                }
            ],
        }
    )


async def admission(request: Request) -> Response:
    """`GET /v1/admission`: the engine's admission snapshot: pool, gates, queue, rejections, rates, model state."""
    return JSONResponse(_state(request).engine.snapshot())


async def health(request: Request) -> Response:
    """`GET /health`: 200 while the model serves; 503 with the model state (or `shutting_down`) otherwise.

    A node poisoned by repeated device faults also says why (`fault_cause`, the last fault's error text).
    """
    state = _state(request)
    health = state.engine.health
    model_state = health.state
    if state.draining:
        return JSONResponse({"status": "shutting_down", "model_state": model_state}, status_code=503)
    if model_state != "loaded":
        body = {"status": model_state, "model_state": model_state}
        if health.fault_cause is not None:  # poisoned for good: say why
            body["fault_cause"] = health.fault_cause
        return JSONResponse(body, status_code=503)
    return JSONResponse({"status": "ok", "model_state": model_state, "model": state.engine.model_name})


async def metrics(request: Request) -> Response:
    """`GET /metrics`: Prometheus text."""
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    log = logger.info if exc.status < 500 else logger.warning
    log("request %s: %d %s: %s", request_id_of(request.scope), exc.status, exc.code, exc.message)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    if code is None:
        error = APIError("invalid_request", str(exc.detail), status=exc.status_code, error_type="invalid_request_error")
    else:
        detail = f"no route {request.method} {request.url.path}" if code == "not_found" else str(exc.detail)
        error = APIError(code, detail)
    return error_response(error, dict(exc.headers or {}))


def create_app(engine: Engine, settings: ServerSettings | None = None) -> Starlette:
    """The OpenAI-compatible app over a started `engine`; `app.state.helexa` is its `ServerState`.

    Middleware: request ids and the last-resort 500 handler, Bearer auth on `/v1/*` when
    `settings.api_key` is set, the request-body limit.
    """
    settings = settings or ServerSettings()
    state = ServerState(
        engine=engine, settings=settings, metrics=ServerMetrics(engine), logprobs=LogprobFormatter(engine.tokenizer)
    )
    routes = [
        *(Route(path, generate, methods=["POST"]) for path in FORMATS),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/admission", admission, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    middleware = [
        Middleware(RequestContextMiddleware, metrics=state.metrics, generation_paths=frozenset(FORMATS)),
        Middleware(AuthMiddleware, api_key=settings.api_key),
        Middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes),
    ]
    app = Starlette(
        routes=routes, middleware=middleware, exception_handlers={APIError: _api_error, HTTPException: _http_error}
    )
    app.state.helexa = state
    return app
