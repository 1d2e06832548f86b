"""A KV event consumer for the tests, written from the wire protocol alone (as llm-d's indexer reads it):
a SUB socket for the live stream, a DEALER for replays, and the block-hash set the events describe."""

from __future__ import annotations

import time

import msgspec
import zmq

from helexa.cluster import END_OF_REPLAY, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode_batch


class Subscriber:
    """Receives `(topic, seq, payload)` messages on a SUB socket; `replay(start)` asks the ROUTER for more."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: bytes = b"") -> None:
        ctx = zmq.Context.instance()
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.RCVHWM, 0)  # keep everything until the test reads it
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)  # before connect: no event missed
        self._joined = False
        self.sock.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.live: dict[int, bytes] = {}  # seq -> payload, as received on the live stream
        self.topics: set[bytes] = set()

    def wait_joined(self, timeout: float = 10.0) -> None:
        """Wait until the SUB socket's connection to the publisher has finished its handshake, after which its
        subscription is on the wire. A PUB drops what it sends before the subscription reached it (ZMQ's slow
        joiner), so a test that needs the live stream from a given batch on waits here before that batch is made."""
        if not self._joined:
            if not self._monitor.poll(int(timeout * 1000)):
                raise AssertionError(f"the subscriber did not connect within {timeout}s")
            self._monitor.recv_multipart()
            self._joined = True

    def receive(self, until_seq: int, timeout: float = 10.0) -> None:
        """Read the live stream until a message with sequence number >= `until_seq` arrived."""
        deadline = time.monotonic() + timeout
        while not self.live or max(self.live) < until_seq:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                raise AssertionError(f"no KV event {until_seq} within {timeout}s (got {sorted(self.live)[-3:]})")
            frames = self.sock.recv_multipart()
            assert len(frames) == 3, frames
            topic, seq, payload = frames
            assert len(seq) == 8
            self.topics.add(topic)
            self.live[int.from_bytes(seq, "big")] = payload

    def replay(self, start: int, timeout: float = 10.0) -> dict[int, bytes]:
        """Every buffered batch from `start` on, by the replay protocol (a DEALER: `[b"", start]` out,
        `[b"", seq, payload]` back until the end marker)."""
        assert self.replay_endpoint is not None
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            got: dict[int, bytes] = {}
            while True:
                if not dealer.poll(int(timeout * 1000)):
                    raise AssertionError("the replay did not end")
                empty, seq, payload = dealer.recv_multipart()
                assert empty == b""
                if seq == END_OF_REPLAY:
                    assert payload == b""
                    return got
                got[int.from_bytes(seq, "big")] = payload
        finally:
            dealer.close()

    def close(self) -> None:
        self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close()


class BlockSet:
    """The set of block hashes a stream of batches describes; strict: a block is never stored twice or removed
    while absent (the stream must be exact, not merely converge)."""

    def __init__(self) -> None:
        self.hashes: set[int] = set()
        self.stored: list[BlockStored] = []
        self.removed = 0
        self.cleared = 0

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                assert len(event.token_ids) == len(event.block_hashes) * event.block_size
                for h in event.block_hashes:
                    assert h not in self.hashes, f"block {h:#x} stored twice"
                    self.hashes.add(h)
                self.stored.append(event)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    assert h in self.hashes, f"block {h:#x} removed but not stored"
                    self.hashes.discard(h)
                self.removed += len(event.block_hashes)
            else:
                assert isinstance(event, AllBlocksCleared)
                self.hashes.clear()
                self.cleared += 1


def rebuild(payloads: dict[int, bytes]) -> BlockSet:
    """Apply batches 0, 1, 2, ... (asserting there is no gap) and return the block set they describe."""
    assert sorted(payloads) == list(range(len(payloads))), "sequence numbers have a gap"
    blocks = BlockSet()
    for seq in range(len(payloads)):
        blocks.apply(decode_batch(payloads[seq]))
    return blocks


def raw(payload: bytes) -> list:
    """A payload as plain msgpack values (no schema): the positional layout the wire carries."""
    return msgspec.msgpack.decode(payload)
