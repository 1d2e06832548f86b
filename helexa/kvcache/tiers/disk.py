"""The disk tier: one file per block in a directory, checksummed, written by a background thread.

A file is `blocks/<hash>.kvb`: a fixed header (magic, the identity's digest, the block's chain hash and
parent, its token count, the payload's length and CRC-32), the token ids (int64), the header's own CRC-32,
then the K/V payload. A read verifies all of it against what the lookup expects; any mismatch, a short
file or an I/O error is a miss (the file is deleted, the failure counted), never wrong KV.

Writes are asynchronous and batched: `put` indexes the block at once and keeps its K/V in memory until
the writer thread has written the file (a read meanwhile is served from memory), so no engine step waits
for the disk. `identity.json` records what the blocks were computed with; opening the directory under
another identity discards every block (with a log line); under the same one, the blocks survive a restart.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from helexa.kvcache.tiers.host import TierCounters
from helexa.kvcache.tiers.identity import KVIdentity
from helexa.kvcache.tiers.index import TierBlock, TierIndex

__all__ = ["DiskTier"]

logger = logging.getLogger("helexa.kvcache")

_MAGIC = b"HXKVB\x01\r\n"
_HEAD = struct.Struct("<8s32sQQBIQI")  # magic, identity digest, hash, parent, first, tokens, payload bytes, payload crc
_CRC = struct.Struct("<I")
_SUFFIX = ".kvb"


def file_bytes(num_tokens: int, payload_bytes: int) -> int:
    """The size of one block's file."""
    return _HEAD.size + 8 * num_tokens + _CRC.size + payload_bytes


class DiskTier:
    """Blocks' K/V in files under `path`, `capacity_bytes` at most (file sizes), with its own LRU (`TierIndex`).

    `lock` is the owning `KVTiers`' lock: every call is made with it held, and the writer thread takes it to
    settle each write. `on_lost(block)` is told (lock held) of a block a failed write took out of the tier.
    """

    name = "disk"
    medium = "DISK"

    def __init__(
        self,
        path: str | os.PathLike,
        capacity_bytes: int,
        identity: KVIdentity,
        *,
        lock: threading.RLock,
        on_lost: Callable[[TierBlock], None] = lambda block: None,
    ) -> None:
        self.path = Path(path)
        self.identity = identity
        self.index = TierIndex(capacity_bytes)
        self.counters = TierCounters()
        self._lock = lock
        self._on_lost = on_lost
        self._pending: dict[int, torch.Tensor] = {}  # hash -> K/V not yet on disk
        self._queue: list[TierBlock | int] = []  # a block to write, or a hash whose file to delete
        self._busy = False  # the writer holds a batch
        self._stop = False
        self._wake = threading.Condition(lock)
        self._blocks_dir = self.path / "blocks"
        self._open()
        self._thread = threading.Thread(target=self._writer, name="helexa-kv-disk", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the owner's calls (lock held)

    def put(self, block: TierBlock, payload: torch.Tensor, now: float) -> list[tuple[TierBlock, None]]:
        """Index `block` now and queue its file (`payload`: its K/V, a copy the tier may keep until written);
        returns the blocks dropped to make room (the block itself when it can never fit)."""
        dropped = self.index.add(block, now)
        for victim in dropped:
            if victim is not block:
                self._forget(victim.hash)
        if not dropped or dropped[-1] is not block:
            self._pending[block.hash] = payload
            self._queue.append(block)
            self.counters.writes += 1
            self._wake.notify()
        self.counters.drops += len(dropped)
        return [(victim, None) for victim in dropped]

    def read(self, block: TierBlock) -> torch.Tensor | None:
        """The block's K/V, verified (header, identity, hash, parent, tokens, length, checksum), or None: then the
        block is out of the tier and the failure counted."""
        if self.index.get(block.hash) is not block:
            return None
        pending = self._pending.get(block.hash)
        if pending is not None:
            return pending
        try:
            data = self._read_file(self._file(block.hash))
            payload = self._verify(data, block)
        except (OSError, ValueError) as exc:
            logger.warning("kv tiers: disk block %016x not loaded (%s); it is a miss", block.hash, exc)
            self.counters.failures += 1
            self.discard(block.hash)
            self._on_lost(block)
            return None
        return payload

    def discard(self, h: int) -> TierBlock | None:
        """Drop the block with hash `h` (its file is deleted by the writer); None when it is not here."""
        block = self.index.remove(h)
        if block is not None:
            self._forget(h)
        return block

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write and delete is done (True), or `timeout` seconds pass (False)."""
        deadline = time.monotonic() + timeout
        with self._wake:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(left)
            return True

    def close(self) -> None:
        """Finish the queued writes, then stop the writer thread."""
        self.flush()
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        self._thread.join(timeout=30)

    def check_integrity(self) -> None:
        self.index.check_integrity()
        if not set(self._pending) <= {b.hash for b in self.index}:
            raise RuntimeError("disk tier: K/V waiting to be written for a block it does not hold")

    # ------------------------------------------------------------------ file I/O (the hooks a fault test replaces)

    def _write_file(self, path: Path, data: list[bytes | memoryview]) -> None:
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            for part in data:
                f.write(part)
        os.replace(tmp, path)

    def _read_file(self, path: Path) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    # ------------------------------------------------------------------ internals

    def _file(self, h: int) -> Path:
        return self._blocks_dir / f"{h:016x}{_SUFFIX}"

    def _forget(self, h: int) -> None:
        self._pending.pop(h, None)
        self._queue.append(h)
        self._wake.notify()

    def _encode(self, block: TierBlock, payload: torch.Tensor) -> list[bytes | memoryview]:
        raw = memoryview(payload.contiguous().view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        tokens = struct.pack(f"<{len(block.tokens)}q", *block.tokens)
        head = _HEAD.pack(
            _MAGIC, self.identity.digest, block.hash, block.parent, block.first, len(block.tokens), len(raw),
            zlib.crc32(raw),
        )  # fmt: skip
        return [head, tokens, _CRC.pack(zlib.crc32(head + tokens)), raw]

    def _header(self, data: bytes) -> tuple[TierBlock, int, int]:
        """The block a file's header describes, where its payload starts and the payload's CRC; `ValueError` for
        a header that is short, damaged or of another identity."""
        if len(data) < _HEAD.size:
            raise ValueError(f"short header ({len(data)} bytes)")
        magic, digest, h, parent, first, n, size, crc = _HEAD.unpack_from(data)
        if magic != _MAGIC or digest != self.identity.digest:
            raise ValueError("another format or identity")
        start = _HEAD.size + 8 * n + _CRC.size
        if len(data) < start or _CRC.unpack_from(data, start - _CRC.size)[0] != zlib.crc32(data[: start - _CRC.size]):
            raise ValueError("header checksum mismatch")
        if size != self.identity.payload_bytes or n != self.identity.block_size:
            raise ValueError(f"payload of {size} bytes for {n} tokens")
        tokens = struct.unpack_from(f"<{n}q", data, _HEAD.size)
        return TierBlock(h, parent, bool(first), tuple(tokens), start + size), start, crc

    def _verify(self, data: bytes, block: TierBlock) -> torch.Tensor:
        found, start, crc = self._header(data)
        if found.hash != block.hash or not found.matches(block.parent, block.tokens) or found.first != block.first:
            raise ValueError("the file holds another block")
        payload = data[start:]
        if len(payload) != self.identity.payload_bytes:
            raise ValueError(f"truncated: {len(payload)} of {self.identity.payload_bytes} payload bytes")
        if zlib.crc32(payload) != crc:
            raise ValueError("payload checksum mismatch")
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return flat.view(self.identity.torch_dtype).reshape(self.identity.block_shape)

    def _open(self) -> None:
        """Use the directory: keep its blocks when they were written under this identity, else discard them."""
        self._blocks_dir.mkdir(parents=True, exist_ok=True)
        marker = self.path / "identity.json"
        mine = self.identity.to_json()
        try:
            theirs = marker.read_text()
        except FileNotFoundError:
            theirs = None
        files = sorted(self._blocks_dir.iterdir(), key=_mtime)
        if theirs != mine:
            if files:
                logger.warning(
                    "kv tiers: disk %s was written for another model, dtype or block shape (%s); discarding its %d "
                    "blocks", self.path, theirs or "no identity", len(files),
                )  # fmt: skip
            for f in files:
                f.unlink(missing_ok=True)
            marker.write_text(mine)
            return
        bad = over = 0
        for f in files:
            try:
                if f.suffix != _SUFFIX:
                    raise ValueError("not a block file")
                with open(f, "rb") as fh:
                    head = fh.read(_HEAD.size + 8 * self.identity.block_size + _CRC.size)
                block = self._header(head)[0]
                if f.stat().st_size != block.nbytes or f.name != f"{block.hash:016x}{_SUFFIX}":
                    raise ValueError("wrong size or name")
            except (OSError, ValueError):
                bad += 1
                f.unlink(missing_ok=True)
                continue
            for victim in self.index.add(block, 0.0):
                over += 1
                self._file(victim.hash).unlink(missing_ok=True)
        logger.info(
            "kv tiers: disk %s kept %d blocks (%.1f MiB) from before; discarded %d unreadable, %d over the budget",
            self.path, len(self.index), self.index.nbytes / 2**20, bad, over,
        )  # fmt: skip

    def _writer(self) -> None:
        """Write queued blocks and delete dropped ones, a batch at a time, outside the lock."""
        while True:
            with self._wake:
                while not self._queue and not self._stop:
                    self._wake.wait()
                if not self._queue:
                    return
                batch, self._queue, self._busy = self._queue, [], True
                work: list[tuple[int, TierBlock | None, torch.Tensor | None]] = []
                for item in batch:
                    if isinstance(item, int):
                        if self.index.get(item) is None:
                            work.append((item, None, None))
                    elif self.index.get(item.hash) is item and item.hash in self._pending:
                        work.append((item.hash, item, self._pending[item.hash]))
            results: list[tuple[TierBlock | None, OSError | None]] = []
            for h, block, payload in work:  # the K/V of a block is never changed once given to a tier
                try:
                    if block is None or payload is None:
                        self._file(h).unlink(missing_ok=True)
                    else:
                        self._write_file(self._file(h), self._encode(block, payload))
                    results.append((block, None))
                except OSError as exc:
                    results.append((block, exc))
            with self._wake:
                for block, error in results:
                    if block is None or self.index.get(block.hash) is not block:
                        continue
                    if error is None:
                        self._pending.pop(block.hash, None)
                        continue
                    logger.warning("kv tiers: disk write of block %016x failed (%s); it is dropped", block.hash, error)
                    self.counters.failures += 1
                    self.counters.drops += 1
                    self.discard(block.hash)
                    self._on_lost(block)
                self._busy = False
                self._wake.notify_all()


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
