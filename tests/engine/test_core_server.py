"""The engine core's serving half (`CoreServer`) in this process, on a socket pair, as the server's side drives it
with call frames: every request's events reach the channel in order, a step's several requests' in one frame,
and a request that ends, by its limit or aborted mid-stream, leaves nothing behind in the core's reader."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

from helexa.engine import Engine
from helexa.engine.core.process import CoreServer
from helexa.engine.core.wire import ChannelClosed, read_frame, to_plain, write_frame
from helexa.model.sampling import SamplingParams
from tests.support.engines import tiny_engine_config


class _Peer:
    """The server's end of the channel: sends calls, collects replies and every request's events."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.replies, self.events = sock, {}, defaultdict(list)
        self.frames: list[int] = []  # events a frame
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            while True:
                frame = read_frame(self.sock)
                with self.cond:
                    if frame[0] == "reply":
                        self.replies[frame[1]] = frame
                    elif frame[0] == "events":
                        self.frames.append(len(frame[1]))
                        for request_id, event, _ in frame[1]:
                            self.events[request_id].append(event)
                    self.cond.notify_all()
        except (ChannelClosed, OSError):
            pass

    def call(self, call_id: int, method: str, *args: object) -> None:
        write_frame(self.sock, ("call", call_id, method, list(args)))

    def wait(self, done, timeout: float = 60) -> None:
        with self.cond:
            assert self.cond.wait_for(done, timeout), "timed out"


def _finished(event: object) -> bool:
    reason = event[2] if type(event) is tuple else event["finish_reason"]
    return reason is not None


def _serving(engine: Engine) -> tuple[CoreServer, threading.Thread, socket.socket, socket.socket]:
    """`engine` started and served by a `CoreServer` on a thread: (the server, its thread, its end, the peer's)."""
    engine.start()
    near, far = socket.socketpair()
    server = CoreServer(engine, near)
    serving = threading.Thread(target=server.serve, daemon=True)
    serving.start()
    return server, serving, near, far


def test_requests_that_end_or_are_aborted_leave_nothing_in_the_core(tiny_model_dir: Path) -> None:
    engine = Engine(tiny_engine_config(tiny_model_dir, num_blocks=256, max_num_seqs=4))
    server, serving, near, far = _serving(engine)
    peer = _Peer(far)
    try:
        short = to_plain(SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        long = to_plain(SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True))
        for i, params in enumerate([short, short, long], 1):
            peer.call(i, "submit", [5, 6, 7, 8 + i], params, f"r{i}", None, None)
        peer.wait(lambda: {1, 2, 3} <= peer.replies.keys())
        assert all(peer.replies[i][2] for i in (1, 2, 3)), peer.replies  # all admitted
        peer.wait(lambda: len(peer.events["r3"]) >= 3)  # the long one is streaming
        peer.call(0, "abort", "r3")
        peer.wait(lambda: all(peer.events[r] and _finished(peer.events[r][-1]) for r in ("r1", "r2", "r3")))
        assert [len(peer.events[r]) for r in ("r1", "r2")] == [6, 6]
        assert peer.events["r3"][-1][2] == "abort" and len(peer.events["r3"]) < 500
        assert sum(peer.frames) > len(peer.frames)  # a step's events of several requests share a frame
        deadline = time.monotonic() + 10
        while server._reader.num_streams and time.monotonic() < deadline:  # the last frame is sent as it empties
            time.sleep(0.01)
        assert server._reader.num_streams == 0 and not server._handles and not server._unstarted
        peer.call(9, "shutdown", 0.0)
        peer.wait(lambda: 9 in peer.replies)
        serving.join(timeout=30)
        assert not serving.is_alive()
    finally:
        far.close()
        near.close()
        engine.shutdown()


def test_an_embedded_core_whose_channel_ends_stops_serving_and_leaves_its_process_alone(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `CoreServer` embedded in another process (this test's, a benchmark's) has no `on_channel_end`: when the
    server's end closes without a shutdown, `serve` returns and nothing exits the process. (Its reader once
    looked the core process's exit up at the channel's end: a test's sockets closed as it ended could kill the
    pytest worker after the test had put its stand-in back.)"""
    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)  # an exit is recorded here, not taken
    engine = Engine(tiny_engine_config(tiny_model_dir, num_blocks=64, max_num_seqs=2))
    _, serving, near, far = _serving(engine)
    try:
        peer = _Peer(far)
        peer.call(1, "snapshot")
        peer.wait(lambda: 1 in peer.replies)
        far.shutdown(socket.SHUT_RDWR)  # the server is gone, no shutdown asked (and the peer's reader wakes)
        far.close()
        serving.join(timeout=30)
        assert not serving.is_alive()  # serve returned; this process goes on
    finally:
        near.close()
        engine.shutdown()
    assert exits == []
