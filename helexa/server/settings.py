"""The server's own settings (the engine's are `EngineConfig`): one frozen dataclass, validated once."""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass

from helexa.server.middleware import DEFAULT_MAX_BODY_BYTES

__all__ = ["DEFAULT_SHUTDOWN_GRACE_SECS", "ServerSettings", "is_loopback"]

DEFAULT_SHUTDOWN_GRACE_SECS = 30.0


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
    """Where and how the HTTP server listens.

    - `host`, `port`: the bind address (port 0: any free port).
    - `api_key`: when set, `/v1/*` requires `Authorization: Bearer <api_key>`.
    - `max_body_bytes`: largest request body; larger ones get 413 `request_too_large`.
    - `shutdown_grace_secs`: on SIGTERM/SIGINT, how long in-flight requests may run before they are aborted.
    - `log_level`: the `logging` level name for helexa's and uvicorn's loggers.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    shutdown_grace_secs: float = DEFAULT_SHUTDOWN_GRACE_SECS
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be a positive integer, got {self.max_body_bytes!r}")
        if not (self.shutdown_grace_secs >= 0 and math.isfinite(self.shutdown_grace_secs)):
            raise ValueError(f"shutdown_grace_secs must be a finite number >= 0, got {self.shutdown_grace_secs!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")
        if self.log_level.lower() not in ("critical", "error", "warning", "info", "debug"):
            raise ValueError(f"log_level must be critical, error, warning, info or debug; got {self.log_level!r}")

    @property
    def exposed_without_key(self) -> bool:
        """True when the server listens beyond this machine with no API key (worth a warning)."""
        return self.api_key is None and not is_loopback(self.host)
