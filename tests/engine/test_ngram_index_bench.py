"""`bench/ngram_index.py` (the prompt-lookup index's compiled tables against its Python dicts) runs both kinds on
the same tokens, and its report, JSON and plot say what it measured."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import ModuleType

import pytest

from helexa.engine.speculative import ngram
from tests.support.bench import bench_module


class _Tokens:
    """A tokenizer stand-in: text that repeats stretches of itself, as docs do."""

    def encode(self, text: str) -> list[int]:
        rng = random.Random(0)
        ids = [rng.randrange(500) for _ in range(4000)]
        for _ in range(40):
            at, to = rng.randrange(len(ids) - 30), rng.randrange(len(ids))
            ids[to:to] = ids[at : at + 30]
        return ids


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    module = bench_module("ngram_index", monkeypatch)
    monkeypatch.setattr(module, "load_tokenizer", _Tokens)
    return module


def test_both_kinds_are_measured_and_reported(bench: ModuleType, tmp_path: Path) -> None:
    if not ngram.compiled_tables():
        pytest.skip(f"the compiled n-gram tables are unavailable here: {ngram.native_unavailable_reason()}")
    assert (
        bench.main(
            ["--lengths", "256,1024", "--steps", "200", "--repeats", "2", "--sessions", "2", "--out", str(tmp_path)]
        )
        == 0
    )
    results = json.loads((tmp_path / "ngram_index.json").read_text())
    assert [row["tokens"] for row in results["lengths"]] == [256, 1024]
    for row in results["lengths"]:
        compiled, dicts = row["compiled"], row["dicts"]
        assert compiled["found"] == dicts["found"] > 0  # the same drafts found, and the text recurs
        assert compiled["held"] < dicts["held"] and compiled["step"] > 0 and dicts["index"] > 0
    sessions = results["sessions"]
    assert sessions["compiled"]["tokens"] == sessions["dicts"]["tokens"] == 2 * 4 * 4001
    assert sessions["compiled"]["held"] < sessions["dicts"]["held"]
    text = (tmp_path / "ngram_index.md").read_text()
    assert "CPU: " in text and "tables: compiled" in text and "| 1,024 |" in text and "Session store" in text
    assert (tmp_path / "ngram_index.png").stat().st_size > 0


def test_too_short_a_text_is_refused(bench: ModuleType, tmp_path: Path) -> None:
    if not ngram.compiled_tables():
        pytest.skip(f"the compiled n-gram tables are unavailable here: {ngram.native_unavailable_reason()}")
    with pytest.raises(SystemExit, match="too few"):
        bench.main(["--lengths", "6000", "--steps", "100", "--out", str(tmp_path)])
