"""A request's grammar, compiled once, off the event loop, within a size and a time budget.

Structured output (`response_format`, `text.format`) and forced tool calls (`tool_choice` "required"
or a named function) constrain decoding with an llguidance grammar. Compiling one can take seconds
for a hostile schema (an `anyOf` thousands wide, a 50k-item enum), so it never runs on the event
loop's thread: `GrammarCompiler.constrain` compiles in its own small pool of threads (llguidance
releases the GIL), once per request (its `n` choices copy one matcher), and keeps the result
(bounded caches in `helexa.model.sampling.grammar`). What it refuses, with a 400 `invalid_request`
naming the field (`response_format` / `text.format`, or `tools`):

- a schema whose JSON text is over `MAX_SCHEMA_BYTES` (the output format's; the tools' parameter
  schemas together), before any work;
- a schema or grammar llguidance cannot compile, or whose compiled size passes its own limits;
- a compile still running after `COMPILE_BUDGET_SECS` (it finishes in the background, bounded by
  llguidance's limits, on one of `COMPILE_THREADS` threads: a flood queues instead of taking every core).

llguidance resolves `$ref` chains by recursion (a chain of 2,500 references overflows a default 8 MiB
thread stack and kills the process), so the compile threads run on `COMPILE_STACK_BYTES` stacks
(address space: only the pages a compile touches become resident), deep enough for any schema
within `MAX_SCHEMA_BYTES`.

Memory: the compiled grammars and ready matchers are cached within fixed bounds (`grammar.py`), and
after compiling a large schema (over `TRIM_AFTER_BYTES` of JSON text) the compile thread hands the C
heap's free pages back to the system (glibc's `malloc_trim`, at most once every `TRIM_EVERY_SECS`):
llguidance's temporary structures for an `anyOf` thousands wide are tens of MiB, which glibc's
arenas would otherwise keep resident.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from helexa.heap import release_free_pages
from helexa.model.sampling.grammar import GrammarError, GrammarTokenizer, json_schema_grammar
from helexa.server.errors import APIError
from helexa.server.protocol import GenerationRequest
from helexa.server.tools import ToolCalling

__all__ = ["COMPILE_BUDGET_SECS", "COMPILE_STACK_BYTES", "COMPILE_THREADS", "MAX_SCHEMA_BYTES", "GrammarCompiler"]

MAX_SCHEMA_BYTES = 512 << 10  # JSON text of one output format's schema, or of all tools' parameters
COMPILE_BUDGET_SECS = 5.0  # longest a request waits for its grammar (queued behind others included)
COMPILE_THREADS = 2
COMPILE_STACK_BYTES = 256 << 20
TRIM_AFTER_BYTES = 64 << 10
TRIM_EVERY_SECS = 2.0  # at most one trim this often: a trim walks the whole heap

T = TypeVar("T")


class _DeepStackPool:
    """`threads` daemon threads with `stack_bytes` stacks, running submitted calls in order."""

    def __init__(self, threads: int, stack_bytes: int, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        previous = threading.stack_size(stack_bytes)  # applies to threads started until it is reset
        try:
            self._threads = [
                threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(threads)
            ]
            for thread in self._threads:
                thread.start()
        finally:
            threading.stack_size(previous)

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self._calls.put((future, fn))
        return future

    def _run(self) -> None:
        while True:
            future, fn = self._calls.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 — handed to the waiting request
                future.set_exception(exc)


_POOL: _DeepStackPool | None = None
_POOL_LOCK = threading.Lock()


def _compile_pool() -> _DeepStackPool:
    """The process's compile threads (one pool, however many apps: a flood queues on `COMPILE_THREADS`)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = _DeepStackPool(COMPILE_THREADS, COMPILE_STACK_BYTES, "helexa-grammar")
        return _POOL


class GrammarCompiler:
    """Compiles requests' grammars for one engine (`tools`: the model's tool-call format;
    `grammar_tokenizer`: the engine's vocabulary, whose matchers it prepares)."""

    def __init__(
        self,
        tools: ToolCalling,
        grammar_tokenizer: GrammarTokenizer,
        *,
        budget_secs: float = COMPILE_BUDGET_SECS,
        max_schema_bytes: int = MAX_SCHEMA_BYTES,
    ) -> None:
        self.tools, self.grammar_tokenizer = tools, grammar_tokenizer
        self.budget_secs, self.max_schema_bytes = budget_secs, max_schema_bytes
        self._pool = _compile_pool()

    async def constrain(self, req: GenerationRequest) -> GenerationRequest:
        """`req` with its `grammar` set (its forced tool calls', else its output format's; unchanged when it has
        neither) and the grammar's matcher ready for the engine; 400 as the module docstring says."""
        if req.format_schema is None and not self._forces_tools(req):
            return self.tools.constrain(req)  # at most a sampling tweak for the tools' format: no grammar
        future = asyncio.wrap_future(self._pool.submit(lambda: self._compile(req)))
        try:
            return await asyncio.wait_for(future, self.budget_secs)
        except TimeoutError:
            param = "tools" if self._forces_tools(req) else req.format_param
            raise APIError(
                "invalid_request",
                f"{param}: the schema did not compile within {self.budget_secs:g} s; send a smaller or simpler one",
                param=param,
            ) from None

    @staticmethod
    def _forces_tools(req: GenerationRequest) -> bool:
        """Whether the tools add a grammar: a forced call, or "auto" calls beside an output format."""
        return (
            req.tools is not None
            and req.tool_choice != "none"
            and (req.tool_choice == "required" or req.format_schema is not None)
        )

    def _compile(self, req: GenerationRequest) -> GenerationRequest:
        size = 0
        if req.format_schema is not None:
            size += self._check_size(req.format_schema, req.format_param)
        if self._forces_tools(req):
            assert req.tools is not None
            size += self._check_size([t["function"].get("parameters") for t in req.tools], "tools")
        try:
            return self._compiled(req)
        finally:
            if size > TRIM_AFTER_BYTES:
                _trim_heap()

    def _compiled(self, req: GenerationRequest) -> GenerationRequest:
        req = self.tools.constrain(req)  # the forced calls' grammar (400 naming the tool that fails)
        param = "tools" if self._forces_tools(req) else req.format_param
        try:
            grammar = req.grammar
            if grammar is None:
                assert req.format_schema is not None
                grammar = json_schema_grammar(req.format_schema)
                req = dataclasses.replace(req, grammar=grammar)
            self.grammar_tokenizer.prepare(grammar)
        except GrammarError as exc:
            raise APIError("invalid_request", f"{param}: {exc}", param=param) from None
        return req

    def _check_size(self, schema: Any, param: str) -> int:
        """The size of `schema`'s JSON text; 400 naming `param` over `max_schema_bytes`."""
        size = len(json.dumps(schema, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass"))
        if size > self.max_schema_bytes:
            raise APIError(
                "invalid_request",
                f"{param}: the schema's JSON text is {size} bytes, over the limit of {self.max_schema_bytes}",
                param=param,
            )
        return size


_last_trim = 0.0


def _trim_heap() -> None:
    """Return the C heap's free pages to the system (a no-op without glibc, or within `TRIM_EVERY_SECS` of
    the last trim)."""
    global _last_trim
    now = time.monotonic()
    if now - _last_trim >= TRIM_EVERY_SECS:
        _last_trim = now
        release_free_pages()
