"""The Starlette app: OpenAI-compatible routes over a running `Engine`."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from helexa.engine import EngineClient, ServingEngine, TokenEvent
from helexa.model.text.chat_template import ChatTemplateBroken
from helexa.model.text.tokenizer import TooManyTokens
from helexa.server.backend import backend_routes
from helexa.server.connections import ConnectionLimit, ConnectionLimitMiddleware
from helexa.server.dashboard import Dashboard
from helexa.server.errors import APIError, error_response
from helexa.server.formats import FORMATS, RENDERED, ApiFormat, LogprobFormatter
from helexa.server.generation import Choice, GenerationRun, event_error
from helexa.server.metrics import ServerMetrics
from helexa.server.middleware import (
    LARGE_BODY_BYTES,
    AuthMiddleware,
    BodyLimitMiddleware,
    RequestContextMiddleware,
    mark_client_gone,
    request_id_of,
)
from helexa.server.protocol import GenerationRequest, decode_json, parse_detokenize, parse_tokenize
from helexa.server.settings import ServerSettings
from helexa.server.sse import EventStreamResponse, race_disconnect, sse
from helexa.server.structured import GrammarCompiler
from helexa.server.tenancy import isolated_salt
from helexa.server.tools import ToolCalling

logger = logging.getLogger("helexa.server")


@dataclass
class ServerState:
    """What every route reads: the engine, the settings, the metrics, and whether the server is draining."""

    engine: ServingEngine
    settings: ServerSettings
    metrics: ServerMetrics
    logprobs: LogprobFormatter
    connections: ConnectionLimit
    tools: ToolCalling
    grammars: GrammarCompiler
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False


def _state(request: Request) -> ServerState:
    return request.app.state.helexa


def _prompt_ids(state: ServerState, req: GenerationRequest) -> list[list[int]]:
    """Token ids of each prompt: the rendered chat template, or the completion prompt (text or ids)."""
    tokenizer, limit = state.engine.tokenizer, state.engine.max_model_len - 1
    _check_can_fit(state, req)
    param = "prompt" if req.kind == "completion" else "input" if req.kind == "response" else "messages"
    try:
        if req.messages is not None:
            try:
                messages, tools = state.tools.conversation(req)
                return [
                    tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools, max_length=limit)
                ]
            except TooManyTokens:
                raise
            except ValueError as exc:  # ChatTemplateError is a ValueError
                raise _template_error(exc, param) from None
        ids = [tokenizer.encode(p, max_length=limit) if isinstance(p, str) else list(p) for p in req.prompts]
    except TooManyTokens as exc:  # refused before its ids are built: it can never run here
        raise APIError(
            "context_length_exceeded",
            f"prompt of {exc.count} tokens leaves no room for output: the maximum context length is "
            f"{state.engine.max_model_len} tokens",
            param=param,
        ) from None
    if any(not p for p in ids):
        raise APIError("invalid_request", "the prompt is empty after tokenisation", param="prompt")
    return ids


def _template_error(exc: ValueError, param: str) -> APIError:
    """The answer to a conversation the chat template did not render: 400 naming `param` when the conversation
    is to blame (malformed, refused by the template's own `raise_exception` or by the sandbox's bounds); 500
    `template_error` when the template broke for a reason of its own (the server's fault; logged as a
    `WARNING` with the request id, as every 5xx)."""
    if isinstance(exc, ChatTemplateBroken):
        return APIError("template_error", f"the server's chat template is broken, not the request: {exc}")
    return APIError("invalid_request", f"chat template: {exc}", param=param)


def _check_can_fit(state: ServerState, req: GenerationRequest) -> None:
    """400 `context_length_exceeded` before rendering or tokenising a prompt whose text is too long to fit in any
    tokenisation (more UTF-8 bytes than `max_model_len` tokens of the longest token can hold): tokenising
    megabytes takes seconds and memory for a request that can never run. Everything that reaches the chat
    template counts (`_template_text_bytes`): message text, tool calls and tool results, and the tools (shown
    to the model unless `tool_choice` is "none"); `param` names `tools` when they alone cannot fit."""
    engine = state.engine
    limit = engine.max_model_len * engine.tokenizer.max_token_bytes
    param = "messages" if req.messages is not None else "prompt"
    if req.messages is not None:
        tools = req.tools if req.tool_choice != "none" else None
        tool_bytes = _template_text_bytes(tools, keys=True)
        sizes = [_template_text_bytes(req.messages, keys=False) + tool_bytes]
        param = "tools" if tool_bytes > limit else param
    else:
        sizes = [_utf8_len(p) for p in req.prompts if isinstance(p, str)]
    if sizes and max(sizes) > limit:
        raise APIError(
            "context_length_exceeded",
            f"the prompt's {max(sizes)} bytes of text cannot fit the maximum context length of "
            f"{engine.max_model_len} tokens (no token of this model stands for more than "
            f"{engine.tokenizer.max_token_bytes} bytes)",
            param=param,
        )


def _template_text_bytes(value: object, keys: bool) -> int:
    """UTF-8 bytes of every string in `value` (a JSON value: messages, tools), the object keys too with `keys`
    (tools reach a template as JSON, keys and all). Iterative: a body's depth is bounded, its width is not."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += _utf8_len(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
            if keys:
                stack.extend(item.keys())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def _check_logit_bias(state: ServerState, req: GenerationRequest) -> None:
    """400 naming `logit_bias` when it biases a token id outside the model's vocabulary."""
    vocab = state.engine.tokenizer.vocab_size
    bad = next((t for t in req.logit_bias or () if t >= vocab), None)
    if bad is not None:
        raise APIError(
            "invalid_request", f"logit_bias token id {bad} is outside the vocabulary [0, {vocab})", param="logit_bias"
        )


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def _observe(state: ServerState, run: GenerationRun) -> None:
    for waited in run.admission_waits:
        state.metrics.observe_admission_wait(waited)
    if run.first_token_at is not None:
        state.metrics.observe_ttft(run.first_token_at - run.started)


async def _read_json_object(request: Request) -> dict[str, Any]:
    """The request's body as a JSON object: 415 unless its Content-Type is JSON (`_json_body_type`), 400 when
    it is not a JSON object (`decode_json`); a body of `LARGE_BODY_BYTES` or more is parsed on a worker
    thread, so the event loop keeps answering the other connections."""
    _json_body_type(request)
    raw = await request.body()
    if len(raw) >= LARGE_BODY_BYTES:
        return await run_in_threadpool(decode_json, raw)
    return decode_json(raw)


async def generate(request: Request) -> Response | EventStreamResponse:
    """`POST /v1/chat/completions`, `/v1/completions`, `/v1/responses`: one route, shaped by the path's format.

    A stream answers only after its run's first event, so admission errors (a queue timeout included) are
    real HTTP errors with their Retry-After; a client gone before the answer aborts the run and gets 499.
    """
    state = _state(request)
    if state.draining:
        raise APIError("shutting_down", "the server is shutting down and admits no new requests")
    parse, fmt_type = FORMATS[request.url.path]
    req = parse(await _read_json_object(request), state.settings.allow_additional_properties)
    if state.settings.prefix_cache_isolation == "per-key":  # each key (and tenant) salts its own prefixes
        req = dataclasses.replace(req, cache_salt=isolated_salt(request.headers, req.cache_salt))
    _check_logit_bias(state, req)
    await run_in_threadpool(_check_can_fit, state, req)  # before the grammar and the template see the tools
    req = await state.grammars.constrain(req)  # off the event loop, once for all choices
    prompt_ids = await run_in_threadpool(_prompt_ids, state, req)
    run_id = f"{fmt_type.id_prefix}{uuid.uuid4().hex}"
    run = GenerationRun(state.engine, run_id, prompt_ids, req, lambda: state.tools.parser_for(req))
    # A grammar: each choice copies the prepared matcher (a worker thread even if it was evicted); an engine core
    # in its own process: a round trip, which may wait while the core restarts. Neither runs on the event loop.
    if req.grammar is not None or isinstance(state.engine, EngineClient):
        await run_in_threadpool(run.submit)
    else:
        run.submit()
    fmt = fmt_type(req, run, state.engine.model_name, state.logprobs)
    if req.stream:
        events = run.events()
        first = asyncio.ensure_future(anext(events))

        def client_gone() -> None:
            run.abort()
            logger.info("request %s: client disconnected mid-stream; aborted", request_id_of(request.scope))
            mark_client_gone(request.scope)

        if run.queue_status() is not None:  # waiting for admission: answer now and say so while it waits
            chunks = _stream_queued(state, fmt, first, events, request)
            return EventStreamResponse(chunks, client_gone)
        if not await race_disconnect(request.receive, first):
            await events.aclose()
            run.abort()
            logger.info("request %s: client disconnected before the first token; aborted", request_id_of(request.scope))
            mark_client_gone(request.scope)
            return Response(status_code=499)
        error = event_error(first.result()[1])
        if error is not None:
            await events.aclose()
            raise error

        return EventStreamResponse(_stream(state, fmt, first.result(), events, request), client_gone)
    try:
        if not await race_disconnect(request.receive, asyncio.ensure_future(run.finish())):
            run.abort()
            logger.info(
                "request %s: client disconnected before completion; aborted %d choices",
                request_id_of(request.scope),
                len(run.handles),
            )
            mark_client_gone(request.scope)
            return Response(status_code=499)
        for choice in run.choices:
            if (error := event_error(choice)) is not None:
                raise error
        return JSONResponse(fmt.body())
    finally:
        _observe(state, run)


async def render(request: Request) -> Response:
    """`POST /v1/chat/completions/render`, `/v1/completions/render` (vLLM's shapes): the prompt's token ids as
    the generation route would build them (same validation, same chat template), without generating.

    Chat answers one object, completions a list (one per prompt); each carries `token_ids` (what a KV-aware
    router hashes into blocks), the `model` and the request's `sampling_params`.
    """
    state = _state(request)
    parse, _ = FORMATS[request.url.path.removesuffix("/render")]
    req = parse(await _read_json_object(request), state.settings.allow_additional_properties)  # no grammar built
    prompt_ids = await run_in_threadpool(_prompt_ids, state, req)
    params: dict[str, object] = {**req.sampling, "max_tokens": req.max_tokens, "n": req.n, "seed": req.seed}
    bodies = [
        {
            "request_id": f"render-{uuid.uuid4().hex}",
            "token_ids": ids,
            "features": None,
            "sampling_params": params,
            "model": state.engine.model_name,
            "stream": req.stream,
            "cache_salt": req.cache_salt,
        }
        for ids in prompt_ids
    ]
    return JSONResponse(bodies if req.kind == "completion" else bodies[0])


async def _stream_queued(
    state: ServerState,
    fmt: ApiFormat,
    first: asyncio.Future[tuple[Choice, TokenEvent]],
    events: AsyncGenerator[tuple[Choice, TokenEvent], None],
    request: Request,
) -> AsyncGenerator[bytes, None]:
    """A stream whose request waits for admission: `: queued position N, estimated start in S s` comments
    (the first at once, then every `queue_comment_secs`) until its first event, then the stream itself.
    A queue timeout then arrives as the stream's error event."""
    try:
        while not first.done():
            status = fmt.run.queue_status()
            if status is not None:
                yield f": queued position {status[0]}, estimated start in {status[1]:.0f} s\n\n".encode()
            await asyncio.wait({first}, timeout=state.settings.queue_comment_secs)
        async for chunk in _stream(state, fmt, first.result(), events, request):
            yield chunk
    finally:
        first.cancel()
        await events.aclose()


async def _stream(
    state: ServerState,
    fmt: ApiFormat,
    first: tuple[Choice, TokenEvent],
    events: AsyncGenerator[tuple[Choice, TokenEvent], None],
    request: Request,
) -> AsyncGenerator[bytes, None]:
    failed, run = False, fmt.run
    try:
        pending = list(fmt.start())  # written with the first event's chunks
        item: tuple[Choice, TokenEvent] | None = first
        while item is not None:
            choice, event = item
            error = event_error(event)
            if error is not None:
                logger.warning(
                    "request %s: stream ended with %s: %s", request_id_of(request.scope), error.code, error.message
                )
                pending.append(sse(error.body()))
                failed = True
                break
            pending.extend(fmt.event(choice, event))
            if pending and not run.ready():  # several events of one step (a kept draft) go in one write
                yield b"".join(pending)
                pending.clear()
            item = await anext(events, None)
        pending.extend(fmt.end(failed))
        if pending:
            yield b"".join(pending)
    finally:
        await events.aclose()
        _observe(state, fmt.run)


def _json_body_type(request: Request) -> None:
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":  # a browser page can send the others without a CORS preflight
        raise APIError("unsupported_media_type", f"Content-Type must be application/json, got {media_type or 'none'}")


async def tokenize(request: Request) -> Response:
    """`POST /tokenize` (vLLM's shape): the token ids of a prompt, or of chat messages as the template renders
    them, with their count and the node's `max_model_len`."""
    state = _state(request)
    req = parse_tokenize(await _read_json_object(request))
    tokenizer = state.engine.tokenizer

    def ids() -> list[int]:
        if req.chat is not None:
            try:
                messages, tools = state.tools.conversation(req.chat)  # as the chat route renders them
                return tokenizer.apply_chat_template(
                    messages, add_generation_prompt=req.add_generation_prompt, tools=tools
                )
            except ValueError as exc:  # ChatTemplateError is a ValueError
                raise _template_error(exc, "messages") from None
        assert req.prompt is not None
        return tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)

    tokens = await run_in_threadpool(ids)
    return JSONResponse({"count": len(tokens), "max_model_len": state.engine.max_model_len, "tokens": tokens})


async def detokenize(request: Request) -> Response:
    """`POST /detokenize` (vLLM's shape): the text of a list of token ids."""
    state = _state(request)
    tokens = parse_detokenize(await _read_json_object(request))
    vocab = state.engine.tokenizer.vocab_size
    bad = next((t for t in tokens if t >= vocab), None)
    if bad is not None:
        raise APIError("invalid_request", f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    return JSONResponse({"prompt": state.engine.tokenizer.decode(tokens)})


def _model_card(state: ServerState) -> dict[str, object]:
    """The served model as OpenAI's model object (plus vLLM's `max_model_len`)."""
    engine = state.engine
    return {
        "id": engine.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "helexa",
        "max_model_len": engine.max_model_len,
    }


async def models(request: Request) -> Response:
    """`GET /v1/models`: the one model this server serves."""
    return JSONResponse({"object": "list", "data": [_model_card(_state(request))]})


async def model(request: Request) -> Response:
    """`GET /v1/models/{id}` (OpenAI's retrieve): the served model; 404 `model_not_found` for any other id."""
    state = _state(request)
    model_id = request.path_params["model_id"]
    if model_id != state.engine.model_name:
        raise APIError(
            "model_not_found",
            f"the model {model_id!r} does not exist; this server serves {state.engine.model_name!r}",
            param="model",
        )
    return JSONResponse(_model_card(state))


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
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


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


def create_app(engine: ServingEngine, settings: ServerSettings | None = None) -> Starlette:
    """The OpenAI-compatible app over a started `engine`; `app.state.helexa` is its `ServerState`."""
    settings = settings or ServerSettings()
    tools = ToolCalling(engine.tokenizer, settings.tool_call_parser)
    state = ServerState(
        engine=engine,
        settings=settings,
        metrics=ServerMetrics(engine),
        logprobs=LogprobFormatter(engine.tokenizer),
        connections=ConnectionLimit(settings.max_connections),
        tools=tools,
        grammars=GrammarCompiler(tools, engine.grammar_tokenizer),
    )
    routes = [
        *(Route(path, generate, methods=["POST"]) for path in FORMATS),
        *(Route(f"{path}/render", render, methods=["POST"]) for path in RENDERED),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/admission", admission, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *backend_routes(),  # what vLLM's and SGLang's routers probe: load, server and model info, cache flush
        # `GET /`: the operator page, and its data
        *Dashboard(engine, lambda: state.draining, admin_api_key=settings.admin_api_key).routes(),
    ]
    middleware = [
        Middleware(ConnectionLimitMiddleware, limit=state.connections),
        Middleware(RequestContextMiddleware, metrics=state.metrics, generation_paths=frozenset(FORMATS)),
        Middleware(AuthMiddleware, api_key=settings.api_key, admin_api_key=settings.admin_api_key),
        Middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, timeout_secs=settings.body_timeout_secs),
    ]
    app = Starlette(
        routes=routes, middleware=middleware, exception_handlers={APIError: _api_error, HTTPException: _http_error}
    )
    app.state.helexa = state
    return app
