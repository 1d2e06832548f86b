"""The engine requests behind one HTTP request: submit them, merge their token streams, abort them.

A request with `n` choices over `p` prompts becomes `p × n` engine requests, choice `k = prompt * n + i`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from helexa.admission import AdmissionRejected
from helexa.engine import (
    EngineClosed,
    EngineError,
    RequestFailed,
    RequestHandle,
    ServingEngine,
    TokenEvent,
    TokenLogprob,
)
from helexa.model.sampling import SamplingParams
from helexa.model.tools import ToolCallParser
from helexa.server.errors import APIError, from_admission
from helexa.server.protocol import GenerationRequest


@dataclass
class Choice:
    """One choice's output so far: text, token ids, logprobs, and how it ended."""

    index: int
    prompt_tokens: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    error: BaseException | None = None
    cached_tokens: int = 0  # prompt tokens its sequence found in the prefix cache

    def add(self, event: TokenEvent) -> None:
        """Fold one event in (text deltas are already detokenised and stop-trimmed by the engine)."""
        self.cached_tokens = max(self.cached_tokens, event.num_cached_tokens)
        if event.text:
            self.text.append(event.text)
        self.token_ids.extend(event.token_ids)
        self.logprobs.extend(event.logprobs)
        if event.finished:
            self.finish_reason, self.error = event.finish_reason, event.error

    @property
    def output_text(self) -> str:
        return "".join(self.text)


def _api_error(exc: BaseException | None, param: str | None = None) -> APIError | None:
    """The `APIError` an admission or engine exception stands for; None for any other exception.

    Admission rejections keep their status, code and Retry-After; a closed engine is 503 `shutting_down`;
    `RequestFailed` (the request's own sampling broke) is 400; a `DeviceFault` or other `EngineError` is
    500 `device_fault` carrying the cause; with a `param`, a `ValueError` (a prompt the engine refuses) is 400.
    """
    if isinstance(exc, AdmissionRejected):
        return from_admission(exc)
    if isinstance(exc, EngineClosed):
        return APIError("shutting_down", "the server is shutting down and admits no new requests")
    if isinstance(exc, RequestFailed):
        return APIError("invalid_request", str(exc))
    if isinstance(exc, EngineError):
        return APIError("device_fault", str(exc))
    if isinstance(exc, ValueError) and param is not None:
        return APIError("invalid_request", str(exc), param=param)
    return None


def event_error(event: TokenEvent | Choice) -> APIError | None:
    """The `APIError` a final event (or a finished choice) stands for; None for `stop` / `length`.

    `error`: as `_api_error`, anything else 500 `internal_error`; `abort` reaching a client that is still
    connected means the server aborted it (shutting down): 503 `request_aborted`.
    """
    if event.finish_reason == "abort":
        return APIError("request_aborted", "the request was aborted by the server (shutting down)")
    if event.finish_reason != "error":
        return None
    error = event.error
    return _api_error(error) or APIError("internal_error", f"generation failed: {type(error).__name__}")


class GenerationRun:
    """All engine requests of one HTTP request. Create, `submit()`, then iterate `events()` once.

    `parsers`: a fresh tool-call parser per choice (None: the output is plain text); the formats read
    calls through it too (`new_parser`). A choice whose parser saw a call the answer may not hold
    (`ToolCallParser.ended`: a repeat of an identical call, a second call without parallel calls) ends
    there: its engine request is aborted and its final event is a `stop`, so no model can repeat one
    call until `max_tokens`.

    Timing for the metrics: `started` (monotonic seconds at creation), `first_token_at` (first token of
    any choice), `admission_waits` (seconds each choice waited for its reservation).
    """

    def __init__(
        self,
        engine: ServingEngine,
        request_id: str,
        prompt_ids: list[list[int]],
        request: GenerationRequest,
        parsers: Callable[[], ToolCallParser | None] = lambda: None,
    ) -> None:
        self.engine, self.request_id, self.prompt_ids, self.request = engine, request_id, prompt_ids, request
        self.new_parser = parsers
        self._watch: dict[int, ToolCallParser | None] = {}  # per choice: the parser that spots a call ending it
        self.handles: list[RequestHandle] = []
        self.choices: list[Choice] = []
        self.started = time.monotonic()
        self.first_token_at: float | None = None
        self.admission_waits: list[float] = []
        self._done: set[int] = set()  # choices whose final event arrived
        self._seen: set[int] = set()  # choices that produced any event
        self._waiting: Callable[[], int] = lambda: 0  # events arrived and not yet yielded by `events`

    @property
    def sampling(self) -> dict[str, Any]:
        """The sampling fields in effect (`SamplingParams` keyword arguments): those the client sent, over
        the engine's `sampling_defaults` (the model's generation config) for those it omitted. A field in
        neither is absent: `SamplingParams`' default applies."""
        return {**self.engine.sampling_defaults.sampling(), **self.request.sampling}

    def sampling_params(self, choice: int) -> SamplingParams:
        """The `SamplingParams` of choice `choice` (its seed is the request's + choice number).

        Its sampling fields are `sampling`'s (the client's, over the model's generation config defaults).
        `max_tokens` is the client's; else `_default_max_tokens`.
        """
        req = self.request
        seed = None if req.seed is None else req.seed + choice % req.n
        max_tokens = req.max_tokens if req.max_tokens is not None else self._default_max_tokens(choice)
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                seed=seed,
                logprobs=req.logprobs,
                grammar=req.grammar,
                logit_bias=req.logit_bias,
                **self.sampling,
            )
        except ValueError as exc:
            raise APIError("invalid_request", str(exc), param=str(exc).split(" ", 1)[0]) from None

    def _default_max_tokens(self, choice: int) -> int | None:
        """The output limit of a choice whose request gives none: None lets admission reserve the node's
        default (`min(context left after the prompt, --default-max-tokens)`). A generation config's
        `max_new_tokens` below `--default-max-tokens` lowers that default, still capped by the context
        left (at least 1: a prompt that fills the context is refused by admission as before), so it
        never makes a request unservable that would otherwise be served.
        """
        file_limit = self.engine.sampling_defaults.max_tokens
        if file_limit is None or file_limit >= self.engine.config.admission.default_max_tokens:
            return None
        room = self.engine.max_model_len - len(self.prompt_ids[choice // self.request.n])
        return max(1, min(file_limit, room))

    def submit(self) -> None:
        """Submit every choice, or none: on any failure abort those submitted and raise (`APIError` as
        `_api_error` maps it)."""
        n = self.request.n
        try:
            for p, ids in enumerate(self.prompt_ids):
                for i in range(n):
                    k = p * n + i
                    params = self.sampling_params(k)
                    handle = self.engine.submit(
                        ids,
                        params,
                        request_id=f"{self.request_id}-{k}",
                        cache_salt=self.request.cache_salt,
                        prompt_cache_key=self.request.prompt_cache_key,
                    )
                    self.handles.append(handle)
                    self.choices.append(Choice(index=k, prompt_tokens=handle.prompt_tokens))
        except BaseException as exc:
            self.abort()
            error = _api_error(exc, "prompt" if self.request.kind == "completion" else "messages")
            if error is None:
                raise
            raise error from None

    def abort(self) -> None:
        """Abort every choice that has not finished (idempotent; their blocks return at the next step)."""
        for k, handle in enumerate(self.handles):
            if k not in self._done:
                self.engine.abort(handle.request_id)

    def queue_status(self) -> tuple[int, float] | None:
        """While any choice waits for admission: the best `(queue place, estimated seconds to start)`; else None."""
        waiting = [s for h in self.handles if (s := self.engine.admission.queue_status(h.ticket)) is not None]
        return min(waiting) if waiting else None

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of the request, each prompt counted once (not once per choice)."""
        return sum(len(ids) for ids in self.prompt_ids)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, each prompt counted once (its least-cached choice)."""
        n = self.request.n
        groups = [self.choices[p * n : (p + 1) * n] for p in range(len(self.choices) // n)] if n else []
        return sum(min(c.cached_tokens for c in group) for group in groups if group)

    @property
    def completion_tokens(self) -> int:
        """Output tokens of every choice so far."""
        return sum(len(c.token_ids) for c in self.choices)

    async def events(self) -> AsyncGenerator[tuple[Choice, TokenEvent], None]:
        """`(choice, event)` pairs in arrival order until every choice has ended; each event already folded in.

        Leaving the iteration early (an exception, cancellation, `aclose`) aborts the rest.
        """
        queue: asyncio.Queue[tuple[int, TokenEvent]] = asyncio.Queue()

        async def pump(k: int, handle: RequestHandle) -> None:
            async for event in handle.stream:
                queue.put_nowait((k, event))

        # One choice (most requests) is read from its stream directly; several are merged through the queue.
        single = self.handles[0].stream if len(self.handles) == 1 else None
        tasks = [] if single is not None else [asyncio.ensure_future(pump(k, h)) for k, h in enumerate(self.handles)]
        self._waiting = (lambda: single.pending) if single is not None else queue.qsize
        try:
            while len(self._done) < len(self.handles):
                k, event = (0, await single.aget()) if single is not None else await queue.get()
                if k in self._done:  # the abort's own final event, after a call ended the choice
                    continue
                event = self._end_at_call(k, event)
                choice = self.choices[k]
                if event.token_ids and self.first_token_at is None:
                    self.first_token_at = time.monotonic()
                if k not in self._seen:  # the first event of a choice: it was granted (or ended unstarted)
                    self._seen.add(k)
                    waited = self.handles[k].ticket.waited_seconds
                    if waited is not None:
                        self.admission_waits.append(waited)
                choice.add(event)
                if event.finished:
                    self._done.add(k)
                yield choice, event
        finally:
            for task in tasks:
                task.cancel()
            self.abort()

    def ready(self) -> bool:
        """True when `events` has an event to yield at once (one that already arrived): a streaming response
        then writes this event's chunks together with the next one's. (An event of a choice that already
        ended is dropped by `events`, so with several choices this may say True once for one.)"""
        return self._waiting() > 0

    def _end_at_call(self, k: int, event: TokenEvent) -> TokenEvent:
        """`event`, made final (`stop`) when choice `k`'s text now holds a call that ends the answer
        (`ToolCallParser.ended`); its engine request is then aborted (its blocks return at the next step)."""
        if event.finished:
            return event
        if k not in self._watch:
            self._watch[k] = self.new_parser()
        parser = self._watch[k]
        if parser is None:
            return event
        parser.feed(event.text)
        if not parser.ended:
            return event
        self.engine.abort(self.handles[k].request_id)
        return dataclasses.replace(event, finish_reason="stop")

    async def finish(self) -> None:
        """Run every choice to its end (as `events()`, each event folded in)."""
        async for _ in self.events():
            pass
