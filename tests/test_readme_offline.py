"""The README's offline and research examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks(section: str) -> list[str]:
    text = README.read_text()
    start = text.index(f"## {section}")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start : end if end > 0 else None], flags=re.S)


def test_research_example_runs() -> None:
    blocks = _python_blocks("Offline API and research use")
    assert len(blocks) == 2
    exec(compile(blocks[1], "README research example", "exec"), {})


@pytest.mark.default_model
def test_offline_example_runs(default_model_dir, monkeypatch, capsys) -> None:
    monkeypatch.setenv("HELEXA_HOME", str(default_model_dir.parents[1]))
    # As a user runs it: `auto` attention is the torch reference on CPU (the suite's interpreter is off here).
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    exec(compile(_python_blocks("Offline API and research use")[0], "README offline example", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.count("length") + printed.count("stop") == 2
