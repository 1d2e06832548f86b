"""The grammar caches' bounds (issue 31): least recently used entries go first, by count and by size; a value
too large for the cache is returned and not kept; a grammar's matcher is built once and copied per constraint."""

from __future__ import annotations

from pathlib import Path

from helexa.model.sampling.bitmask import allocate_bitmask
from helexa.model.sampling.grammar import GrammarTokenizer, TokenConstraint, json_schema_grammar
from helexa.model.sampling.grammar_cache import BoundedCache, digest
from helexa.model.text.tokenizer import Tokenizer
from tests.support.models import build_tiny_tokenizer_dir


def test_least_recently_used_entries_are_evicted_by_count_and_by_size() -> None:
    cache: BoundedCache[str] = BoundedCache(max_entries=3, max_bytes=10)
    for key in "abc":
        assert cache.get_or_build(key, lambda k=key: k * 2, len) == key * 2
    cache.get_or_build("a", lambda: "never built", len)  # a hit: "a" is now the most recent
    cache.get_or_build("d", lambda: "dd", len)  # a fourth entry: "b", the least recent, goes
    assert cache.entries == 3 and cache.bytes == 6
    assert cache.get_or_build("b", lambda: "rebuilt", len) == "rebuilt"  # (and "c" went to make room)
    cache.get_or_build("e", lambda: "e" * 9, len)  # 9 bytes: everything older is evicted to fit
    assert cache.entries == 1 and cache.bytes == 9
    assert cache.get_or_build("f", lambda: "f" * 11, len) == "f" * 11  # larger than the whole cache: not kept
    assert cache.entries == 1 and cache.bytes == 9


def test_keys_do_not_collide_across_parts() -> None:
    assert digest("ab", "c") != digest("a", "bc")


def test_a_grammar_is_validated_once_and_each_constraint_is_a_copy(tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(build_tiny_tokenizer_dir(tmp_path / "tok"))
    tokenizer = GrammarTokenizer(tok.backend.to_str(), tuple(sorted(tok.eos_token_ids)))
    grammar = json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    tokenizer.prepare(grammar)
    first, second = tokenizer.constraint(grammar), tokenizer.constraint(grammar)
    assert first._matcher is not second._matcher  # each request advances its own state
    fresh = _mask(second)
    first.accept(next(t for t in range(tokenizer.vocab_size) if _allows(first, t)))
    assert _mask(first) != fresh  # the first moved on ...
    assert _mask(second) == fresh == _mask(tokenizer.constraint(grammar))  # ... and no copy moved with it
    assert tokenizer._matchers.entries == 1  # one matcher was built and kept for all three


def _mask(constraint: TokenConstraint) -> list[int]:
    mask = allocate_bitmask(1, constraint.vocab_size)
    constraint.fill(mask, 0)
    return mask[0].tolist()


def _allows(constraint: TokenConstraint, token: int) -> bool:
    return bool((_mask(constraint)[token // 32] >> (token % 32)) & 1)
