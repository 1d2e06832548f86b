"""Running the app under uvicorn: the start-up line, and a graceful drain on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType

import uvicorn
from starlette.applications import Starlette

from helexa.engine import ServingEngine
from helexa.server.connections import GuardedH11Protocol, quiet_accept_errors
from helexa.server.settings import ServerSettings

logger = logging.getLogger("helexa.server")

_AFTER_DRAIN_SECS = 5.0  # after the engine stopped, how long uvicorn waits for responses still being written


def startup_line(engine: ServingEngine, host: str, port: int) -> str:
    """The one line printed when the server listens: address, model, device, dtype, KV budget in blocks and tokens."""
    budget, gib = engine.budget, engine.budget.kv_cache_bytes / (1 << 30)
    size = f"{gib:.2f} GiB" if gib >= 1 else f"{gib * 1024:.1f} MiB"
    shown_host = f"[{host}]" if ":" in host else host
    return (
        f"helexa: serving {engine.model_name} on http://{shown_host}:{port}"
        f" | device={engine.device} dtype={str(engine.dtype).removeprefix('torch.')}"
        f" | kv={budget.num_blocks} blocks x {budget.block_size} tokens = {budget.num_tokens} tokens"
        f" ({size})"
        f" | max_model_len={engine.max_model_len}"
    )


class RedactQuery(logging.Filter):
    """Drops the query string from uvicorn's access-log lines: it may carry a key or a user's data."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], args[2].partition("?")[0] + "?<redacted>", *args[3:])
        return True


_ACCESS_FILTER = RedactQuery()


class HelexaServer(uvicorn.Server):
    """`uvicorn.Server` that drains on the first SIGTERM/SIGINT instead of stopping at once.

    The drain stops admitting (new generation requests and `/health` get 503 `shutting_down`), lets
    in-flight requests finish for up to `shutdown_grace_secs`, aborts the rest (`engine.shutdown`),
    then closes the listener; `run()` returns normally. A second signal during the drain exits at once.
    `bound_port` is the port actually bound (useful with port 0): None until start-up has finished.
    """

    def __init__(self, app: Starlette, engine: ServingEngine, settings: ServerSettings) -> None:
        protocol = type("HelexaH11", (GuardedH11Protocol,), {"header_timeout": settings.header_timeout_secs})
        config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_config=None,
            log_level=settings.log_level,
            lifespan="off",
            timeout_graceful_shutdown=int(_AFTER_DRAIN_SECS),
            http=protocol,
            backlog=4096,
        )
        super().__init__(config)
        app.state.helexa.connections.connections = self.server_state.connections  # counted by the protocol
        quiet_accept_errors()
        access = logging.getLogger("uvicorn.access")
        if _ACCESS_FILTER not in access.filters:
            access.addFilter(_ACCESS_FILTER)
        self.app, self.engine, self.settings = app, engine, settings
        self.bound_port: int | None = None
        self._drain_requested = False
        self._drain_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """Bind (uvicorn), then log the start-up line with the real port, and warn when exposed without a key."""
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.should_exit or not self.servers:
            return
        self.bound_port = self.servers[0].sockets[0].getsockname()[1]
        logger.info("%s", startup_line(self.engine, self.settings.host, self.bound_port))
        if self.settings.exposed_without_key:
            logger.warning(
                "listening on %s without an API key: anyone who can reach this address can use the "
                "model; pass --api-key or set HELEXA_API_KEY",
                self.settings.host,
            )

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """First signal: start the drain. Second: exit now. (Unlike uvicorn's, never re-raises the signal.)"""
        if self._drain_requested or self._loop is None:
            logger.warning("second %s: exiting without waiting for in-flight requests", signal.Signals(sig).name)
            self.should_exit = self.force_exit = True
            return
        logger.info(
            "%s: draining; new requests get 503, in-flight ones have %.0f s to finish",
            signal.Signals(sig).name,
            self.settings.shutdown_grace_secs,
        )
        self._drain_requested = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        """Stop admitting, give in-flight requests the grace period, abort the rest, then let uvicorn exit."""
        self.app.state.helexa.draining = True
        try:
            await asyncio.to_thread(self.engine.shutdown, self.settings.shutdown_grace_secs)
        finally:
            self.should_exit = True
        logger.info("drained: the engine stopped; closing the listener")
