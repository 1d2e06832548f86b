"""Issue 31, item 5, through the real start path and a real server: a malformed tokenizer.json fails the start
with one clear line; a chat template that fails on every conversation refuses to start with its own error; at
request time the template's `raise_exception` stays a 400 and any other template failure is a logged 500."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from helexa.config import EngineConfig
from helexa.engine.engine import Engine
from tests.support.servers import serving


def _with_template(tiny_model_dir: Path, tmp_path: Path, template: str) -> Path:
    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def _start(model: Path) -> subprocess.CompletedProcess[str]:
    """`python -m helexa.server` on `model`, expected to exit before serving."""
    argv = [sys.executable, "-m", "helexa.server", "--model", str(model), "--device", "cpu", "--port", "0"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_a_malformed_tokenizer_json_fails_the_start_with_one_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": ')
    done = _start(model)
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert "Traceback" not in done.stderr, done.stderr
    [line] = [line for line in lines if "tokenizer.json" in line]
    assert "cannot load the model" in line and "is not a tokenizer the tokenizers library can read" in line


@pytest.mark.parametrize(
    "template, error",
    [
        ("{{ raise_exception('this template needs a system message') }}", "needs a system message"),
        ("{{ messages[0]['content'] + 1 }}", "TypeError"),
        ("{% for m in messages %}{{ m.content | no_such_filter }}{% endfor %}", "no_such_filter"),
    ],
)
def test_a_template_that_fails_on_every_conversation_refuses_to_start(
    tiny_model_dir: Path, tmp_path: Path, template: str, error: str
) -> None:
    model = _with_template(tiny_model_dir, tmp_path, template)
    with pytest.raises(ValueError, match=error):  # the template's own error, in the engine's start
        Engine(EngineConfig(model=str(model), device="cpu", num_blocks=16))
    if error == "TypeError":  # and through the command line: one line, exit 1
        done = _start(model)
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
        assert "fails on a one-message conversation" in done.stderr and "TypeError" in done.stderr


BREAKS_ON_COUNT = (
    "{% for m in messages %}{% if m.content == 'count' %}{{ m.content.no_such_method() }}"
    "{% elif m.role == 'system' %}{{ raise_exception('no system messages, please') }}"
    "{% else %}{{ m.role + ': ' + m.content }}{% endif %}{% endfor %}"
)


def test_at_request_time_raise_exception_is_a_400_and_a_broken_template_a_500(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = _with_template(tiny_model_dir, tmp_path, BREAKS_ON_COUNT)
    with serving(model, num_blocks=64) as server:
        url = f"{server.url}/v1/chat/completions"
        refused = httpx.post(url, json={"messages": [{"role": "system", "content": "x"}], "max_tokens": 2}, timeout=30)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "invalid_request" and error["param"] == "messages"
        assert "no system messages, please" in error["message"]
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "count"}]
        with caplog.at_level(logging.WARNING, logger="helexa.server"):
            broken = httpx.post(url, json={"messages": messages, "max_tokens": 2}, timeout=30)
        assert broken.status_code == 500, broken.text
        error = broken.json()["error"]
        assert error["code"] == "template_error" and error["type"] == "server_error"
        assert "chat template is broken, not the request" in error["message"]
        assert any("template_error" in r.getMessage() for r in caplog.records)
        ok = httpx.post(url, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200, ok.text
        snap = httpx.get(f"{server.url}/v1/admission", timeout=10).json()
        assert snap["blocks_reserved"] == 0 and snap["in_flight"] == 0
