"""Issue 31, item 6, through real servers: `--prefix-cache-isolation per-key` keeps one key's (or tenant's)
prefixes from another's `cached_tokens`; `shared` (the default) is vLLM's behaviour; with `--admin-api-key`
only the admin sees request ids and session keys on `/v1/dashboard`."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from helexa.server.settings import ServerSettings
from tests.support.servers import RunningServer, serving, wait_for

PROMPT = "The agent reads the repository, then the failing test, then the stack trace, in that order. " * 4


def _cached(server: RunningServer, key: str, tenant: str | None = None, salt: str | None = None) -> int:
    headers = {"authorization": f"Bearer {key}", **({"x-tenant-id": tenant} if tenant else {})}
    body = {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _idle(server: RunningServer) -> bool:
    return server.engine.admission.in_flight == 0


@pytest.mark.parametrize("isolation", ["shared", "per-key"])
def test_prefix_cache_isolation(tiny_model_dir: Path, isolation: str) -> None:
    settings = ServerSettings(prefix_cache_isolation=isolation)
    with serving(tiny_model_dir, settings=settings, num_blocks=128) as server:
        assert _cached(server, "alice") == 0
        assert wait_for(lambda: _idle(server), 10)
        if isolation == "shared":  # vLLM's behaviour: another client sees the guessed prefix as cached
            assert _cached(server, "mallory") > 0
            return
        assert _cached(server, "mallory") == 0  # another key: nothing of alice's prefix is shared
        assert _cached(server, "alice") > 0  # the same key still shares its own prefix
        assert _cached(server, "alice", tenant="t2") == 0  # and a tenant header narrows it further
        assert _cached(server, "alice", salt="s") == 0  # as does the request's own cache_salt
        assert _cached(server, "alice", salt="s") > 0


def test_only_the_admin_key_sees_request_ids_and_session_keys(tiny_model_dir: Path) -> None:
    settings = ServerSettings(api_key="user-key", admin_api_key="admin-key")
    with serving(tiny_model_dir, settings=settings, num_blocks=64) as server:
        user, admin = ({"authorization": f"Bearer {k}"} for k in ("user-key", "admin-key"))
        session = "secret-session-of-alice"
        body = {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}
        ok = httpx.post(
            f"{server.url}/v1/chat/completions", json={**body, "prompt_cache_key": session}, headers=admin, timeout=30
        )
        assert ok.status_code == 200, ok.text  # the admin key is accepted wherever the API key is
        refused = httpx.post(
            f"{server.url}/v1/chat/completions", json={**body, "max_tokens": 1500}, headers=user, timeout=30
        )  # more blocks than the pool: rejected by admission, listed with its request id
        assert refused.status_code == 400, refused.text
        assert wait_for(lambda: _idle(server), 10)
        seen = httpx.get(f"{server.url}/v1/dashboard", headers=admin, timeout=30).json()
        hidden = httpx.get(f"{server.url}/v1/dashboard", headers=user, timeout=30).json()
        sessions = [o for o in seen["blocks"]["owners"] if o["kind"] == "session"]
        assert [o["id"] for o in sessions] == [session]  # the admin sees the session key
        request_id = seen["rejections"][0]["request_id"]
        assert request_id.startswith("chatcmpl-")
        text = json.dumps(hidden)
        assert session not in text and request_id not in text and "chatcmpl-" not in text
        [pseudonym] = [o["id"] for o in hidden["blocks"]["owners"] if o["kind"] == "session"]
        assert pseudonym.startswith("session-")
        assert hidden["rejections"][0]["request_id"].startswith("request-")
        again = httpx.get(f"{server.url}/v1/dashboard", headers=user, timeout=30).json()
        assert again["rejections"][0]["request_id"] == hidden["rejections"][0]["request_id"]  # stable
        assert httpx.get(f"{server.url}/v1/dashboard", timeout=30).status_code == 401


def test_the_admin_key_must_differ_from_the_api_key() -> None:
    with pytest.raises(ValueError, match="admin_api_key must differ"):
        ServerSettings(api_key="k", admin_api_key="k")
