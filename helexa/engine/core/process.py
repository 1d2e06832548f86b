"""The engine core's process: `python -m helexa.engine.core FD` runs an `Engine` behind the core channel.

The server (`EngineClient`) starts this module with a fresh interpreter and one end of a socket pair.
The first frame is the `EngineConfig`; the core loads the engine (admission, scheduler, KV owner,
model runner, tensor-parallel workers), answers `("ready", info)` (or `("load_error", error)`) and then
serves calls and streams every request's token events back, several per frame. It dies with its
parent: `PR_SET_PDEATHSIG` on Linux, and an end of stream on the channel (the server is gone) stops
the engine and exits. Ctrl-C in the terminal reaches the server only; the server shuts the core down.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from helexa.config import EngineConfig
from helexa.engine.core.client import core_nice
from helexa.engine.core.wire import (
    ChannelClosed,
    encode_error,
    event_to_plain,
    from_plain,
    read_frame,
    to_plain,
    write_frame,
)
from helexa.engine.engine import Engine
from helexa.engine.interface import RequestHandle
from helexa.engine.stream import RequestStream, StreamReader, TokenEvent
from helexa.heap import freeze_heap
from helexa.model.sampling import SamplingParams

logger = logging.getLogger("helexa.engine.core")

__all__ = ["CoreServer", "main"]

_HEALTH_POLL_SECS = 0.05
_QUEUE_EVERY = 5  # polls: the queue's places go out every 0.25 s while a request waits
_PR_SET_PDEATHSIG = 1


class CoreServer:
    """Serves one `Engine` over the core channel `sock` until the server shuts it down or goes away.

    Guarantees: every call frame gets exactly one reply frame (`abort` excepted: it has none); every
    submitted request's events reach the channel in order, ending with its final event; a change of the
    model's health is sent within `_HEALTH_POLL_SECS`. Calls run on the reader thread (each is short:
    admission decides at once) except `flush_prefix_cache` and `shutdown`, which wait for the loop.
    """

    def __init__(
        self, engine: Engine, sock: socket.socket, on_channel_end: Callable[[Engine], None] | None = None
    ) -> None:
        """`on_channel_end(engine)` runs on the reader thread once the channel ends: the core process passes
        `_exit_soon` (stop the engine, exit the process). A server embedded in another process (a test, a
        benchmark) leaves it None: the channel's end then stops `serve`'s loop and never ends the process."""
        self.engine, self.sock = engine, sock
        self._on_channel_end = on_channel_end
        self._write_lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._handles: dict[str, RequestHandle] = {}  # not yet ended, by request id
        self._unstarted: set[str] = set()  # requests none of whose events has gone out yet
        self._reader = StreamReader(self._loop, self._send_events)  # every stream, one frame a step
        self._health: tuple[str, str | None, float | None] | None = None
        self._replied_shutdown = False  # set before shutdown's reply: the channel's end is then no news
        self._calls: dict[str, Callable[..., Any]] = {
            "submit": self._submit,
            "abort": engine.abort,
            "snapshot": engine.snapshot,
            "admission_snapshot": engine.admission.snapshot,
            "view": lambda: to_plain(engine.view()),
            "counters": self._counters,
            "estimate_wait": lambda p, m, worst: engine.admission.estimate_wait(p, m, worst_case=worst),
            "median_wait": lambda default: engine.request_sizes.median_wait(engine.admission.estimate_wait, default),
            "check_integrity": engine.check_integrity,
        }

    # ------------------------------------------------------------------ serving

    def serve(self) -> None:
        """Read calls on a thread, send the streams' events from this one's loop; return once the core should
        exit."""
        threading.Thread(target=self._read, name="helexa-core-reader", daemon=True).start()
        self._health_task = self._loop.create_task(self._watch_health())
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    def _read(self) -> None:
        try:
            while True:
                kind, call_id, method, args = read_frame(self.sock)
                if kind != "call":
                    raise ChannelClosed(f"unexpected frame {kind!r} on the core channel")
                if method in ("shutdown", "flush_prefix_cache"):  # they wait for the loop: never on the reader
                    threading.Thread(target=self._answer, args=(call_id, method, args), daemon=True).start()
                else:
                    self._answer(call_id, method, args)
        except (ChannelClosed, OSError) as exc:
            if self._replied_shutdown:  # the server closes the channel once shutdown is answered: expected
                logger.debug("engine core: the channel closed after shutdown (%s)", exc)
            else:
                logger.warning("engine core: the server is gone (%s); stopping", exc)
            if self._on_channel_end is not None:
                self._on_channel_end(self.engine)
            else:
                with contextlib.suppress(RuntimeError):  # the loop was closed already
                    self._loop.call_soon_threadsafe(self._loop.stop)

    def _answer(self, call_id: int, method: str, args: list[Any]) -> None:
        try:
            if method == "shutdown":
                self.engine.shutdown(float(args[0]))
                self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._finish(call_id)))
                return
            if method == "flush_prefix_cache":
                result = self.engine.flush_prefix_cache(float(args[0]))
            else:
                result = self._calls[method](*args)
            reply: tuple[Any, ...] = ("reply", call_id, True, to_plain(result))  # a field added to a result crosses
        except Exception as exc:
            reply = ("reply", call_id, False, encode_error(exc))
        if call_id:
            self._send(reply)

    def _send(self, frame: Any) -> None:
        with self._write_lock:
            write_frame(self.sock, frame)

    # ------------------------------------------------------------------ calls

    def _submit(
        self, prompt: list[int], params: dict[str, Any], request_id: str, salt: str | None, key: str | None
    ) -> dict[str, Any]:
        handle = self.engine.submit(
            prompt, from_plain(SamplingParams, params), request_id, cache_salt=salt, prompt_cache_key=key
        )
        self._handles[handle.request_id] = handle
        self._loop.call_soon_threadsafe(self._read_stream, handle)
        return {
            "prompt_tokens": handle.prompt_tokens,
            "max_tokens": handle.max_tokens,
            "ticket": to_plain(handle.ticket),
            "queue_status": self.engine.admission.queue_status(handle.ticket),
        }

    def _queued(self) -> list[tuple[str, int, float]]:
        """`(request id, place, estimated seconds to start)` of every request waiting for admission."""
        waiting = []
        for request_id, handle in list(self._handles.items()):
            status = self.engine.admission.queue_status(handle.ticket)
            if status is not None:
                waiting.append((request_id, *status))
        return waiting

    def _counters(self) -> dict[str, Any]:
        events = self.engine.kv_events
        return {
            "counters": to_plain(self.engine.counters),
            "kv_events": None if events is None else (events.published, events.dropped),
        }

    # ------------------------------------------------------------------ events (the loop's thread)

    def _read_stream(self, handle: RequestHandle) -> None:
        self._unstarted.add(handle.request_id)
        self._reader.add(handle.stream)

    def _send_events(self, batch: list[tuple[RequestStream, list[TokenEvent]]]) -> None:
        """The events of a step (every stream's, one wake-up of this loop) as one frame; a request's first
        carries the time its ticket was granted."""
        frame: list[tuple[str, Any, float | None]] = []
        for stream, events in batch:
            request_id = stream.request_id
            granted = None
            if request_id in self._unstarted:
                self._unstarted.discard(request_id)
                granted = self._handles[request_id].ticket.granted_at
            for event in events:
                frame.append((request_id, event_to_plain(event), granted))
                granted = None
            if events[-1].finished:
                self._handles.pop(request_id, None)
        self._send(("events", frame))

    async def _watch_health(self) -> None:
        """Send the model's health when it changes, and the queue's places and estimates every `_QUEUE_EVERY`
        polls while any request waits (the server answers `queue_status` from them, never by a round trip)."""
        health, polls, queued = self.engine.health, 0, False
        while True:
            polls += 1
            if polls % _QUEUE_EVERY == 0:
                waiting = self._queued()
                if waiting or queued:
                    self._send(("queued", waiting))
                queued = bool(waiting)
            now = (health.state, health.fault_cause, health.last_reload_seconds)
            if now != self._health:
                self._health = now
                self._send(("health", *now, health.reload_seconds_left()))
            await asyncio.sleep(_HEALTH_POLL_SECS)

    async def _finish(self, call_id: int) -> None:
        """After `shutdown`: every stream's last events go out, then the reply, then the loop stops."""
        deadline = self._loop.time() + 10
        self._reader.deliver_all()
        while self._reader.num_streams and self._loop.time() < deadline:  # a final event not yet put
            await asyncio.sleep(0.01)
            self._reader.deliver_all()
        self._health_task.cancel()
        self._replied_shutdown = True
        self._send(("reply", call_id, True, None))
        self._loop.stop()


def _exit_soon(engine: Engine) -> None:
    """The server is gone: stop the engine (its tensor-parallel workers with it) and exit within 10 s."""
    threading.Timer(10.0, lambda: os._exit(3)).start()
    try:
        engine.shutdown(0.0)
    finally:
        os._exit(0)


def _die_with_parent() -> None:
    """SIGKILL this process when the server process dies (Linux; elsewhere the channel's end of stream does)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def main(argv: list[str] | None = None) -> int:
    """Run the core on the socket whose descriptor is `argv[0]`, for the server process `argv[1]`."""
    args = sys.argv[1:] if argv is None else argv
    fd, parent = int(args[0]), int(args[1])
    _die_with_parent()
    if os.getppid() != parent:  # the server died before the death signal was armed
        return 3
    nice = core_nice()
    if nice:
        os.nice(nice)  # the server's event loop first on a shared CPU; the core computes in the rest
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle: it shuts the core down
    logging.basicConfig(
        level=os.environ.get("HELEXA_CORE_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s",
    )
    sock = socket.socket(fileno=fd)
    try:
        config = from_plain(EngineConfig, read_frame(sock))
    except ChannelClosed:
        return 3
    started = time.perf_counter()
    try:
        engine = Engine(config)
    except Exception as exc:
        write_frame(sock, ("load_error", encode_error(exc)))
        return 1
    freeze_heap("engine core")  # no collector pause of the loaded heap in the middle of a step
    engine.start()
    info = {
        "pid": os.getpid(),
        "model_name": engine.model_name,
        "max_model_len": engine.max_model_len,
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "budget": to_plain(engine.budget),
        "load_seconds": time.perf_counter() - started,
    }
    write_frame(sock, ("ready", info))
    CoreServer(engine, sock, on_channel_end=_exit_soon).serve()
    return 0
