"""The KV event publisher: a bounded queue, one thread, a ZMQ PUB socket and a replay ROUTER socket.

Wire protocol (vLLM's `ZmqEventPublisher`, which llm-d's KV indexer reads):

- PUB: each batch is one three-frame message `(topic, sequence number, payload)`: the topic as UTF-8
  bytes, the sequence number as 8 bytes big-endian (0, 1, 2, ... over the batches sent, gapless), the
  payload a msgpack `KVEventBatch` (`helexa.cluster.events`).
- ROUTER (replay): a request `[b"", start]` (from a DEALER; a REQ socket adds the empty frame itself)
  with `start` 8 bytes big-endian is answered with every buffered batch whose sequence number is
  `>= start`, in order, each as `[b"", seq, payload]`, then the end marker `[b"", (-1 as 8 signed
  bytes), b""]`. The buffer keeps the last `buffer_batches` batches sent. With `tagged_maps` (vLLM's newer
  format, which vllm-router reads) each reply also carries the topic: `[b"", topic, seq, payload]`.

An endpoint is bound when it contains `*` or `::` or is `ipc://` / `inproc://` (`tcp://*:5557`, or
`tcp://127.0.0.1:*` for a free port) — vLLM's rule — or names a loopback address (`tcp://127.0.0.1:5557`:
a fixed port that survives restarts, for a router on the same host); else connected
(`tcp://epp.ns.svc:5557`: the picker binds, as in llm-d's central mode). The replay endpoint is always bound.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from typing import TYPE_CHECKING

from helexa.cluster.events import KVEventBatch, encode_batch

if TYPE_CHECKING:  # imported by the publisher that opens sockets: an engine without KV events never loads it
    import zmq

__all__ = ["END_OF_REPLAY", "KVEventPublisher", "binds"]

logger = logging.getLogger("helexa.cluster")

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)  # the sequence frame that ends a replay
_POLL_SECONDS = 0.1  # how often the thread looks at the replay socket while no batch arrives (as vLLM)


_LOOPBACK_HOSTS = ("tcp://127.", "tcp://localhost:", "tcp://[::1]:")


def binds(endpoint: str) -> bool:
    """True when `endpoint` is one to bind: vLLM's rule (a wildcard, `::`, `ipc://` or `inproc://`), and a
    loopback address (`tcp://127.0.0.1:5557`): a fixed port on this host only, which a router on the same
    host (vllm-router connects, never binds) keeps reaching across the replica's restarts."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://", *_LOOPBACK_HOSTS))


class KVEventPublisher:
    """Sends `KVEventBatch`es from a thread of its own, so the engine step never waits on the network.

    Guarantees: `publish` never blocks — it enqueues, or when `queue_batches` batches already wait (or
    the publisher is closed) it drops the batch, counts it in `dropped` and returns False. Batches are
    sent in the order they were published; the batches sent carry sequence numbers 0, 1, 2, ... with no
    gap (`published` of them so far). The sockets are created (and bound) in the constructor, so a bad
    or busy address raises `OSError` there, and are used only by the thread after `start()`.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        tagged_maps: bool = False,
        queue_batches: int = 1024,
        buffer_batches: int = 10_000,
        hwm: int = 100_000,
        context: zmq.Context | None = None,
    ) -> None:
        if queue_batches < 1 or buffer_batches < 0:
            raise ValueError(
                f"queue_batches must be >= 1 and buffer_batches >= 0, got {queue_batches}, {buffer_batches}"
            )
        self.topic = topic
        self.tagged_maps = tagged_maps  # events as vLLM's newer tagged maps (vllm-router), else positional arrays
        self.published = 0  # batches sent (the next sequence number)
        self.dropped = 0  # batches dropped because the queue was full or the publisher closed (publishing thread)
        self.failed = 0  # batches that could not be encoded or sent (the publisher's thread)
        self._topic = topic.encode("utf-8")
        self._queue: queue.Queue[KVEventBatch] = queue.Queue(maxsize=queue_batches)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._stop = threading.Event()
        self._queued = 0  # batches accepted by `publish`
        self._done = 0  # of those, sent or failed (the thread)
        self._progress = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        import zmq

        ctx = context or zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.set_hwm(hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            _open(self._pub, endpoint, binds(endpoint))
            if replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                _open(self._replay, replay_endpoint, True)
        except OSError:
            self._close_sockets()
            raise
        self.endpoint = _last_endpoint(self._pub, endpoint)
        self.replay_endpoint = (
            _last_endpoint(self._replay, replay_endpoint) if self._replay is not None and replay_endpoint else None
        )

    def start(self) -> None:
        """Start the sending thread (batches published before it wait in the queue, up to its bound)."""
        if self._thread is not None:
            raise RuntimeError("the KV event publisher is already started")
        self._thread = threading.Thread(target=self._run, name="helexa-kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> bool:
        """Queue `batch` to be sent, without ever blocking; False when it was dropped (queue full, or closed)."""
        if self._closed:
            self.dropped += 1
            return False
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            return False
        with self._progress:
            self._queued += 1
        return True

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait (up to `timeout` seconds) until every batch published before this call was sent or failed;
        True when they all were. For tests and shutdown: the engine never waits on it."""
        with self._progress:
            target = self._queued
            return self._progress.wait_for(lambda: self._done >= target, timeout)

    @property
    def pending(self) -> int:
        """Batches waiting in the queue to be sent."""
        return self._queue.qsize()

    @property
    def capacity(self) -> int:
        """The most batches that may wait in the queue (`queue_batches`)."""
        return self._queue.maxsize

    def close(self, timeout: float = 2.0) -> None:
        """Stop taking batches, send what is queued (for up to `timeout` seconds), close the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is None:
            self._close_sockets()
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("kv events: the publisher thread did not stop within %.1fs; %d batches unsent",
                           timeout, self._queue.qsize())  # fmt: skip

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            while not (self._stop.is_set() and self._queue.empty()):
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    batch = self._queue.get(timeout=_POLL_SECONDS)
                except queue.Empty:
                    continue
                self._send(batch)
                with self._progress:
                    self._done += 1
                    self._progress.notify_all()
        finally:
            self._close_sockets()

    def _send(self, batch: KVEventBatch) -> None:
        seq = self.published
        try:
            payload = encode_batch(batch, self.tagged_maps)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        except Exception:  # a bad batch or a closed socket: never kill the thread, never reuse the number
            logger.exception("kv events: could not send batch %d", seq)
            self.failed += 1
            return
        self._buffer.append((seq, payload))
        self.published = seq + 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("kv events: ignored a replay request of %d frames", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        head = (client, b"", self._topic) if self.tagged_maps else (client, b"")  # vllm-router reads a topic frame
        sent = 0
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((*head, seq.to_bytes(8, "big"), payload))
                sent += 1
        self._replay.send_multipart((*head, END_OF_REPLAY, b""))
        logger.debug("kv events: replayed %d batches from %d", sent, start)

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None and not sock.closed:
                sock.close(linger=0)


def _open(sock: zmq.Socket, endpoint: str, bind: bool) -> None:
    import zmq

    try:
        if bind:
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
    except zmq.ZMQError as exc:
        raise OSError(f"kv events: cannot {'bind' if bind else 'connect'} {endpoint}: {exc}") from exc


def _last_endpoint(sock: zmq.Socket, configured: str) -> str:
    """The address a bound socket listens on (a `*` port resolved), else the configured one."""
    import zmq

    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    text = last.decode() if isinstance(last, bytes) else str(last)
    return text if binds(configured) and text else configured
