"""KV cache events in vLLM's wire format: the structs, and their msgpack encoding (msgspec).

A batch is one engine step's events, encoded as the positional msgpack array
`[ts, [event, ...], data_parallel_rank]`; each event is a tagged positional array:

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

This is the layout of vLLM's `vllm/distributed/kv_events.py` while its structs were declared with
msgspec's `array_like=True` (through vLLM v0.23; vllm-project/vllm#42892 later switched the inner events
to tagged maps). llm-d's KV indexer (llm-d-kv-cache, `pkg/kvevents/engineadapter/vllm_adapter.go`)
decodes this positional form in every version, so it consumes helexa's stream unchanged.

Block hashes are unsigned 64-bit ints (`helexa.kvcache.prefix.block_hash`); a first block's parent is
nil. `medium` says where a block lives: the engine's own KV pool is "GPU" on an accelerator (vLLM's name) and
"CPU" where the pool is host memory (a CPU engine); "CPU_HOST" is the host-memory tier below the pool and "DISK"
the disk tier (`pool_medium`).
"""

from __future__ import annotations

import msgspec

__all__ = [
    "MEDIUM",
    "MEDIUM_CPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVCacheEvent",
    "KVEventBatch",
    "decode_batch",
    "encode_batch",
    "pool_medium",
]

MEDIUM = "GPU"  # vLLM's MEDIUM_GPU: the engine's own KV pool on an accelerator (below it: "CPU_HOST", "DISK")
MEDIUM_CPU = "CPU"  # the engine's primary KV pool when it lives in host memory (a CPU engine)


def pool_medium(device_type: str) -> str:
    """The `medium` of blocks in the engine's own pool on a device of type `device_type` ("cpu", "cuda", ...)."""
    return MEDIUM_CPU if device_type == "cpu" else MEDIUM


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """A change to the set of cached blocks; encoded as `[type name, fields...]`."""


class BlockStored(KVCacheEvent):
    """Full blocks newly cached, in chain order: `block_hashes[0]`'s parent is `parent_block_hash` (None for a
    prompt's first block), each later one's is the hash before it; `token_ids` holds their tokens back to back
    (`block_size` per block)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    """Blocks evicted: no longer cached."""

    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Nothing is cached any more (a reload dropped the pool, or the cache was cleared)."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One engine step's events, in the order they happened; `ts` is the wall-clock time (seconds since the
    epoch) the batch was made."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# Event fields have no defaults (as in vLLM), so every one is always written; only a batch's
# `data_parallel_rank` may be omitted, and helexa always sets it.
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch, tagged_maps: bool = False) -> bytes:
    """The msgpack payload of a batch: events as positional arrays, or with `tagged_maps` as vLLM's newer
    tagged maps (`{"type": "BlockStored", "block_hashes": ..., ...}`, every field written), which
    vllm-router's `kv_aware` indexer requires; the batch itself stays `[ts, events, data_parallel_rank]`."""
    if not tagged_maps:
        return _ENCODER.encode(batch)
    events = [{"type": type(e).__name__, **msgspec.structs.asdict(e)} for e in batch.events]
    return _ENCODER.encode([batch.ts, events, batch.data_parallel_rank])


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch from its msgpack payload, its events positional or tagged maps (raises `msgspec.ValidationError`
    or `msgspec.DecodeError` on a bad one)."""
    try:
        return _DECODER.decode(payload)
    except msgspec.ValidationError:
        raw = msgspec.msgpack.decode(payload)
        if not (isinstance(raw, list) and len(raw) == 3 and isinstance(raw[1], list)):
            raise
        if not all(isinstance(e, dict) and e.get("type") in _EVENT_TYPES for e in raw[1]):
            raise
        events = [[e["type"], *(e.get(f) for f in _EVENT_TYPES[e["type"]].__struct_fields__)] for e in raw[1]]
        return msgspec.convert([raw[0], events, raw[2]], KVEventBatch)


_EVENT_TYPES: dict[str, type[KVCacheEvent]] = {c.__name__: c for c in (BlockStored, BlockRemoved, AllBlocksCleared)}
