"""The server's own settings (the engine's are `EngineConfig`), declared like the rest of the config tree."""

from __future__ import annotations

import functools
import ipaddress
from dataclasses import dataclass

from helexa.config import SIZE, SWITCH, TEXT, Rule, option, validate
from helexa.model.tools.parsers import PARSERS
from helexa.server.tenancy import ISOLATION_MODES

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
PORT = Rule("a port in [0, 65535]", lambda v: isinstance(v, int) and 0 <= v <= 65535, int, metavar="N")
_http = functools.partial(option, group="HTTP server")
_api = functools.partial(option, group="API")


def is_loopback(host: str) -> bool:
    """True when `host` only accepts connections from this machine (127.0.0.0/8, ::1, `localhost`)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname: it may resolve to anything


@dataclass(frozen=True)
class ServerSettings:
    """Where and how the HTTP server listens; `api_key` set means `/v1/*` needs `Authorization: Bearer KEY`."""

    host: str = _http("127.0.0.1", "bind address", TEXT)
    port: int = _http(8000, "bind port (0: any free port)", PORT)
    api_key: str | None = _http(None, "require 'Authorization: Bearer KEY' on /v1/* (default: $HELEXA_API_KEY)", TEXT)
    api_key_file: str | None = _http(
        None, "read the API key from this file (keeps it out of the process list)", TEXT, metavar="PATH"
    )
    # 8 MiB: a 128k-token prompt as JSON-escaped text, with room to spare.
    max_body_bytes: int = _http(8 << 20, "largest request body accepted (413 beyond)", SIZE, flag="--max-body-size")
    shutdown_grace_secs: float = _http(
        30.0, "on SIGTERM/SIGINT, how long in-flight requests may finish", Rule.seconds()
    )
    log_level: str = _http("info", "log level of helexa's and uvicorn's loggers", Rule.one_of(*LOG_LEVELS))
    header_timeout_secs: float = _http(
        10.0, "close a connection whose request head has not arrived after this long", Rule.seconds(positive=True)
    )
    body_timeout_secs: float = _http(
        30.0, "408 when a request body stalls this long between two reads", Rule.seconds(positive=True)
    )
    max_connections: int = _http(
        2048,
        "open connections beyond which requests get a fast 503 (/health and /metrics still answer)",
        Rule.at_least(1),
    )
    tool_call_parser: str | None = _api(
        None,
        "how the model writes tool calls (default: read from its chat template; hermes for templates "
        "without tool support)",
        Rule.one_of(*PARSERS),
    )
    allow_additional_properties: bool = _api(
        False,
        "keep JSON Schema's open default in response_format / text.format schemas without strict: an object "
        "that does not say additionalProperties accepts undeclared keys (as vLLM's guidance backend without "
        "disable_additional_properties); by default they are closed, as OpenAI's strict mode and vLLM's "
        "xgrammar close them. Forced tool arguments and strict schemas are always closed",
        SWITCH,
    )
    prefix_cache_isolation: str = _api(
        "shared",
        "who shares cached prefixes when a request sends no cache_salt: 'shared' (every client, vLLM's "
        "behaviour: a client can tell whether a prefix it guesses was cached) or 'per-key' (each API key, "
        "and each X-Tenant-ID header, salts its own)",
        Rule.one_of(*ISOLATION_MODES),
    )
    admin_api_key: str | None = _http(
        None,
        "the key that sees request ids and session keys on /v1/dashboard (other keys see pseudonyms); "
        "accepted wherever --api-key is",
        TEXT,
        metavar="KEY",
    )
    # A queued stream's headers go out at once, then a comment with its place and estimated start this
    # often, so proxies in front never see an idle connection.
    queue_comment_secs: float = _http(5.0, "", Rule.seconds(positive=True), cli=False)

    def __post_init__(self) -> None:
        validate(self)
        if self.admin_api_key is not None and self.admin_api_key == self.api_key:
            raise ValueError("admin_api_key must differ from api_key (otherwise every client is the admin)")

    @property
    def exposed_without_key(self) -> bool:
        """True when the server listens beyond this machine with no API key (worth a warning)."""
        return self.api_key is None and not is_loopback(self.host)
