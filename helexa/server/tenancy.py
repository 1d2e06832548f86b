"""Tenants on one node: whose prefixes may be shared, and who may see whose requests.

- Prefix isolation (`--prefix-cache-isolation`). `shared` (the default, vLLM's behaviour): requests
  without a `cache_salt` share cached prefixes with every other client, so a client can learn whether
  another sent a prefix it guesses (from `cached_tokens` and the time to first token). `per-key`: each
  request's prefixes are salted with its API key (the bearer token it sent) and its `X-Tenant-ID`
  header, when it sends one, beside its own `cache_salt`: only requests with the same key, tenant and
  salt share blocks. Behind a gateway that authenticates tenants, let it set `X-Tenant-ID` (and drop
  any a client sent); on its own, the header only narrows what a key shares.
- The operator's view (`--admin-api-key`). With an admin key, only requests bearing it see request ids
  and session keys (`prompt_cache_key`) on `/v1/dashboard`; every other client sees each replaced by
  a pseudonym (`request-3f2a...`, `session-91c0...`: stable while the server runs, so the page still
  groups a request's rows, and unlinkable to the real value). Without one, every client that passes
  `--api-key` sees them, as before.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Any

from starlette.datastructures import Headers

__all__ = ["ISOLATION_MODES", "TENANT_HEADER", "bearer_token", "is_admin", "isolated_salt", "redact_dashboard"]

ISOLATION_MODES = ("shared", "per-key")
TENANT_HEADER = "x-tenant-id"
_PSEUDONYM_KEY = secrets.token_bytes(32)  # per process: pseudonyms cannot be matched across restarts


def bearer_token(headers: Headers) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, None without one."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def isolated_salt(headers: Headers, cache_salt: str | None) -> str:
    """The prefix-cache salt of a request under `per-key` isolation: its API key's and tenant's digest, and
    its own `cache_salt`. Requests share prefixes exactly when all three are equal (no key and no tenant
    header are values too). The key itself never leaves this function."""
    parts = (bearer_token(headers) or "", headers.get(TENANT_HEADER, ""), cache_salt or "")
    digest = hashlib.sha256("\0".join(f"{len(p)}:{p}" for p in parts).encode("utf-8", "surrogatepass"))
    return f"tenant-{digest.hexdigest()}"


def is_admin(headers: Headers, admin_api_key: str) -> bool:
    """Whether the request bears `admin_api_key` (compared in constant time)."""
    return hmac.compare_digest((bearer_token(headers) or "").encode(), admin_api_key.encode())


def _pseudonym(kind: str, value: Any) -> Any:
    if not isinstance(value, str):
        return value
    mac = hmac.new(_PSEUDONYM_KEY, f"{kind}\0{value}".encode("utf-8", "surrogatepass"), hashlib.sha256)
    return f"{kind}-{mac.hexdigest()[:12]}"


def redact_dashboard(body: dict[str, Any]) -> dict[str, Any]:
    """`build_dashboard`'s JSON with every request id and session key replaced by its pseudonym (the queue,
    the running requests, the rejections and the block map's owners); nothing else changes."""
    out = dict(body)
    for table in ("queue", "running"):
        out[table] = [
            {**row, "id": _pseudonym("request", row.get("id")), "session": _pseudonym("session", row.get("session"))}
            for row in body.get(table, [])
        ]
    out["rejections"] = [
        {**row, "request_id": _pseudonym("request", row.get("request_id"))} for row in body.get("rejections", [])
    ]
    blocks = dict(body.get("blocks", {}))
    blocks["owners"] = [
        {
            **owner,
            "id": _pseudonym("session" if owner.get("kind") == "session" else "request", owner.get("id")),
            "session": _pseudonym("session", owner.get("session")),
        }
        for owner in blocks.get("owners", [])
    ]
    out["blocks"] = blocks
    return out
