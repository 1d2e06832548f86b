"""Structured output: a JSON schema compiled into a token-level grammar that masks each sampling step.

Built on llguidance (a maintained grammar engine: JSON schema → grammar → per-step token masks in
tens of microseconds). `json_schema_grammar(schema)` checks and compiles a schema without a model, so
the server can refuse a bad one with a 400 before anything runs; `GrammarTokenizer(tokenizer_json,
eos_token_ids)` is built once per model; `TokenConstraint` is one request's state: `fill(bitmask,
row)` before sampling, `accept(token)` after (the bitmask: `helexa.model.sampling.bitmask`).

Both steps are cached (bounded, `grammar_cache.BoundedCache`): a source compiles once
(`_SOURCES`: its grammar, or the error it gave), and a grammar is validated against the vocabulary
and built into a matcher once per `GrammarTokenizer`; each constraint is a copy of that matcher
(microseconds), so the `n` choices of a request and every later request with the same schema share
the work. llguidance releases the GIL while it compiles, so a compile in a worker thread does not
stall the others.

A constrained request's output always parses and validates under its schema when it ends by itself
(`stop`); cut at `max_tokens` (`length`) it is a valid prefix.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from helexa.model.sampling.grammar_cache import BoundedCache, digest

if TYPE_CHECKING:
    import torch

__all__ = ["GrammarError", "GrammarTokenizer", "TokenConstraint", "json_schema_grammar", "lark_grammar"]


class GrammarError(ValueError):
    """A schema llguidance cannot compile; the message says why."""


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # a dependency of the package; missing only in a broken install
        raise GrammarError(f"structured output needs the llguidance package: {exc}") from None
    return llguidance


def json_schema_grammar(schema: dict[str, Any] | bool) -> str:
    """The grammar of JSON values valid under `schema` (`{"type": "object"}` for any JSON object),
    compact (no whitespace between tokens). Raises `GrammarError` for a schema it cannot compile."""
    schema = dict(schema) if isinstance(schema, dict) else schema
    if isinstance(schema, dict):
        schema.setdefault("x-guidance", {"whitespace_flexible": False})
    return _compiled("grammar_from_json_schema", json.dumps(schema), "invalid JSON schema")


def lark_grammar(source: str) -> str:
    """The grammar of a Lark text in llguidance's dialect (`%json {schema}` items allowed). Raises
    `GrammarError` when it does not compile."""
    return _compiled("grammar_from_lark", source, "invalid grammar")


# Compiled sources: their grammar or the error they gave (a hostile client's repeats cost nothing either).
_SOURCES: BoundedCache[str | GrammarError] = BoundedCache(max_entries=256, max_bytes=32 << 20)
# A ready matcher's resident memory per byte of its grammar text, measured: ~17 MiB for an `anyOf` of 2,000
# objects (a 0.3 MB grammar) with a 400-token vocabulary; the matchers' bound is counted in these units.
MATCHER_BYTES_PER_GRAMMAR_BYTE = 64
MATCHER_CACHE_BYTES = 192 << 20


def _compiled(builder: str, source: str, what: str) -> str:
    """`source` through llguidance's `LLMatcher.<builder>`, validated and cached; `GrammarError` saying `what`
    failed."""
    result = _SOURCES.get_or_build(
        digest(builder, source, what),
        lambda: _compile(builder, source, what),
        lambda r: len(source) + (len(r) if isinstance(r, str) else 256),
    )
    if isinstance(result, GrammarError):
        raise GrammarError(str(result))
    return result


def _compile(builder: str, source: str, what: str) -> str | GrammarError:
    llg = _llguidance()
    try:
        grammar = getattr(llg.LLMatcher, builder)(source)
    except Exception as exc:  # llguidance raises ValueError/RuntimeError with the reason
        return GrammarError(f"{what}: {exc}")
    ok, problem = _validate(llg, grammar, None)
    return grammar if ok else GrammarError(f"{what}: {problem}")


def _validate(llg: Any, grammar: str, tokenizer: Any) -> tuple[bool, str]:
    problem = llg.LLMatcher.validate_grammar(grammar, tokenizer)
    return (not problem, problem)


class GrammarTokenizer:
    """The model's vocabulary as llguidance sees it, from the model's `tokenizer.json` (built on first use,
    ~0.5 s for a 49k vocabulary; thread-safe). `vocab_size` is the mask's width in tokens. Grammars
    checked against it are kept (`prepare`) as ready matchers, at most `max_matchers` of them and
    `max_matcher_bytes` of their estimated memory (`MATCHER_BYTES_PER_GRAMMAR_BYTE`): a matcher too large
    for the bound is built for its request and not kept."""

    def __init__(
        self, tokenizer_json: str | Callable[[], str], eos_token_ids: tuple[int, ...], max_matchers: int = 64,
        max_matcher_bytes: int = MATCHER_CACHE_BYTES,
    ) -> None:  # fmt: skip
        # The JSON text, or what makes it on first use: a serving process that never sees a grammar does not
        # keep the vocabulary's text (3 MiB on the default model) resident beside its tokenizer.
        self._json, self._eos = tokenizer_json, eos_token_ids
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        # grammar digest -> a fresh matcher to copy (or the error the grammar gives with this vocabulary)
        self._matchers: BoundedCache[Any] = BoundedCache(max_entries=max_matchers, max_bytes=max_matcher_bytes)

    @property
    def llg(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                llg = _llguidance()
                eos = self._eos[0] if self._eos else None
                text = self._json if isinstance(self._json, str) else self._json()
                self._tokenizer = llg.LLTokenizer(text, eos_token=eos)
            return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return int(self.llg.vocab_size)

    def prepare(self, grammar: str) -> None:
        """Check `grammar` against this vocabulary and keep its matcher, so that `constraint(grammar)` is a
        copy (call it off the event loop: this is the slow part). Raises `GrammarError` when it does not fit."""
        self._matcher(grammar)

    def constraint(self, grammar: str) -> TokenConstraint:
        """A fresh constraint for one request: a copy of the grammar's kept matcher (`prepare`d, else
        built now). Raises `GrammarError` when the grammar does not fit this vocabulary."""
        return TokenConstraint(self._matcher(grammar).deep_copy(), self.vocab_size)

    def _matcher(self, grammar: str) -> Any:
        def build() -> Any:
            llg = _llguidance()
            ok, problem = _validate(llg, grammar, self.llg)
            if not ok:
                return GrammarError(f"invalid JSON schema for this model: {problem}")
            return llg.LLMatcher(self.llg, grammar)

        size = (65536 + len(grammar)) * MATCHER_BYTES_PER_GRAMMAR_BYTE  # its estimated resident memory
        matcher = self._matchers.get_or_build(digest(grammar), build, lambda _: size)
        if isinstance(matcher, GrammarError):
            raise GrammarError(str(matcher))
        return matcher


class TokenConstraint:
    """One request's grammar state: which tokens may come next, advanced by each sampled token.
    `vocab_size`: the tokens its mask covers."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher, self.vocab_size = matcher, vocab_size

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of a host int32 bitmask (`allocate_bitmask`, at
        least `vocab_size` bits wide): bit `t % 32` of word `t // 32` is set when token t may come next."""
        import torch  # masks are filled where the model runs, which has torch loaded; compiling needs none

        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
            raise ValueError("fill needs a contiguous int32 bitmask on the host")
        words = -(-self.vocab_size // 32)
        if bitmask.shape[1] < words:
            raise ValueError(f"bitmask rows of {bitmask.shape[1]} words cannot hold {self.vocab_size} tokens")
        target = bitmask[row, :words]  # (words,) contiguous: a row of a contiguous 2-D tensor
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), words * 4)

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token (one the mask allowed)."""
        self._matcher.consume_token(int(token_id))

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the grammar allows from here, one after another (the state is unchanged)."""
        return int(self._matcher.validate_tokens([int(t) for t in tokens])) if tokens else 0

    def fill_ahead(self, bitmask: torch.Tensor, row: int, draft: Sequence[int]) -> None:
        """Rows `row .. row + len(draft)` of `bitmask` (see `fill`): row `row + j` allows what may come after
        the draft's first `j` tokens. The state is the same afterwards. `draft` must be a `valid_prefix`;
        rows after a token the grammar refuses stay as they were (a verifier never emits them: the
        refused token cannot be sampled in the row before)."""
        self.fill(bitmask, row)
        allowed = self.valid_prefix(draft)
        consumed = 0
        try:
            for j in range(allowed):
                self._matcher.consume_token(int(draft[j]))
                consumed += 1
                self.fill(bitmask, row + j + 1)
        finally:
            if consumed:
                self._matcher.rollback(consumed)

    @property
    def done(self) -> bool:
        """True once the grammar is complete and allows nothing but the end."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str | None:
        """The matcher's error, when a token it did not allow was forced on it."""
        return self._matcher.get_error() if self._matcher.is_error() else None
