"""A streamed answer's events go out in as few writes as they arrive in: the events one engine step delivers
for a request (a kept draft's tokens) are written together, every write holds whole events only, and the
client reads the same answer as without drafts."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from pathlib import Path

import httpx
import pytest

from helexa.server import app as server_app
from tests.support.servers import RunningServer, tiny_engine_config


def test_a_step_s_events_go_out_in_one_write(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writes: list[bytes] = []
    stream = server_app._stream

    async def recorded(*args, **kwargs) -> AsyncGenerator[bytes, None]:
        async for chunk in stream(*args, **kwargs):
            writes.append(chunk)
            yield chunk

    monkeypatch.setattr(server_app, "_stream", recorded)
    running = RunningServer(tiny_engine_config(tiny_model_dir, num_blocks=256, max_num_seqs=4, speculative="ngram"))
    try:
        body = {"model": "tiny", "prompt": [5, 6, 7, 8] * 6, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
        plain = httpx.post(f"{running.url}/v1/completions", json={**body, "speculative": False}, timeout=60)
        assert plain.status_code == 200
        streamed = httpx.post(f"{running.url}/v1/completions", json={**body, "stream": True}, timeout=60)
        assert streamed.status_code == 200
    finally:
        running.stop()
    records = [r for r in streamed.text.split("\n\n") if r]
    assert records[-1] == "data: [DONE]"
    assert b"".join(writes).decode() == streamed.text
    assert all(w.endswith(b"\n\n") for w in writes)  # whole events only
    text = "".join(
        choice["text"] for r in records[:-1] for choice in httpx.Response(200, content=r[6:]).json()["choices"]
    )
    assert text == plain.json()["choices"][0]["text"]
    accepted = running.engine.snapshot()["spec_accepted_tokens"]
    assert accepted > 0  # drafts were kept: some steps gave this request several tokens
    assert len(writes) < len(records)  # ... and those went out together
