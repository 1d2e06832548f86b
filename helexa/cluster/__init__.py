"""helexa.cluster: serving as one replica of many behind Kubernetes' inference gateway (llm-d's picker).

- `events`     the KV event types in vLLM's wire format and their msgpack encoding (msgspec).
- `publisher`  `KVEventPublisher`: bounded queue, sending thread, ZMQ PUB, replay ROUTER; never blocks.
- `recorder`   `KVEventRecorder`: the engine's side: prefix-cache changes -> one batch per step.

The metrics the picker scrapes (vLLM's names) are in `helexa.server.metrics`; deploy/ and
docs/scaling.md show a replica joining an `InferencePool`.
"""

from helexa.cluster.events import (
    MEDIUM,
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    decode_batch,
    encode_batch,
    pool_medium,
)
from helexa.cluster.publisher import END_OF_REPLAY, KVEventPublisher, binds
from helexa.cluster.recorder import KVEventRecorder

__all__ = [
    "END_OF_REPLAY",
    "MEDIUM",
    "MEDIUM_CPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVCacheEvent",
    "KVEventBatch",
    "KVEventPublisher",
    "KVEventRecorder",
    "binds",
    "decode_batch",
    "encode_batch",
    "pool_medium",
]
