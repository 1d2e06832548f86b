"""README's "## Serving" and "## Admission" examples, run as written (only the address changed) against the
test server."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.servers import RunningServer

README = Path(__file__).resolve().parents[2] / "README.md"
ADDRESS = "http://127.0.0.1:8000"


def _blocks(heading: str, language: str) -> list[str]:
    text = README.read_text(encoding="utf-8")
    section = text[text.index(f"\n## {heading}\n") + 1 :]
    section = section[: section.find("\n## ") if "\n## " in section else len(section)]
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


def _serving_blocks(language: str) -> list[str]:
    return _blocks("Serving", language)


def _curl_commands() -> list[str]:
    (block,) = _serving_blocks("bash")
    return [cmd.strip() for cmd in block.replace("\\\n", " ").splitlines() if cmd.strip()]


def test_readme_has_an_example_for_every_route() -> None:
    commands = "\n".join(_curl_commands())
    for route in (
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/models",
        "/v1/admission",
        "/health",
        "/metrics",
    ):
        assert f"{ADDRESS}{route}" in commands, route
    (python,) = _serving_blocks("python")
    for call in (
        "chat.completions.create",
        "completions.create",
        "responses.create",
        "responses.stream",
        "models.list",
    ):
        assert call in python


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_readme_curl_examples(server: RunningServer) -> None:
    for command in _curl_commands():
        done = subprocess.run(
            ["bash", "-c", command.replace(ADDRESS, server.url)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, (command, done.stderr)
        out = done.stdout
        if "/metrics" in command:
            assert "helexa_kv_blocks_total" in out
        elif '"stream": true' in command:
            events = [json.loads(line[6:]) for line in out.splitlines() if line.startswith("data: {")]
            assert events and not any(e.get("error") for e in events), out[:500]
            if "/v1/responses" not in command:
                assert out.rstrip().endswith("data: [DONE]")
        else:
            body = json.loads(out)
            assert body.get("error") is None, body


def test_readme_python_example(server: RunningServer) -> None:
    (python,) = _serving_blocks("python")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(python.replace(ADDRESS, server.url), "README.md", "exec"), {})  # noqa: S102 — our own README
    assert "completed" in printed.getvalue() or "incomplete" in printed.getvalue()


def test_readme_prefix_cache_example(server: RunningServer) -> None:
    (python,) = _blocks("Admission", "python")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(python.replace(ADDRESS, server.url), "README.md", "exec"), {})  # noqa: S102 — our own README
    rows = [[int(x) for x in line.split()] for line in printed.getvalue().splitlines()]
    assert [r[0] for r in rows] == [0, 1, 2] and rows[0][2] == 0
    assert rows[1][2] > 0 and rows[2][2] > rows[1][2]  # each turn finds more of its conversation cached
