"""helexa.engine: the continuous-batching loop over the paged KV cache.

Module map:
- `config`     `EngineConfig`: every knob of a loaded engine, validated once.
- `engine`     `Engine`: submit / abort / step / start / shutdown; `RequestHandle`, `EngineClosed`, `EngineError`.
- `scheduler`  `schedule`: decode tokens first, then prefill chunks, under the token budget.
- `runner`     `ModelRunner`: builds each step's inputs once, runs the model, samples.
- `sequence`   `Sequence`: a running request's tokens, cache position and output plumbing.
- `stream`     `RequestStream`, `TokenEvent`: per-request events for threads and asyncio.
- `stats`      `RateTracker`: moving averages of step costs that admission estimates waits from.
"""

from helexa.engine.config import EngineConfig
from helexa.engine.engine import (
    DeviceFault,
    Engine,
    EngineClosed,
    EngineCounters,
    EngineError,
    RequestFailed,
    RequestHandle,
)
from helexa.engine.scheduler import ScheduledChunk, schedule
from helexa.engine.stats import RateTracker
from helexa.engine.stream import RequestStream, TokenEvent, TokenLogprob

__all__ = [
    "DeviceFault",
    "Engine",
    "EngineClosed",
    "EngineConfig",
    "EngineCounters",
    "EngineError",
    "RateTracker",
    "RequestFailed",
    "RequestHandle",
    "RequestStream",
    "ScheduledChunk",
    "TokenEvent",
    "TokenLogprob",
    "schedule",
]
