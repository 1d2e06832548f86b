"""helexa.engine: the continuous-batching loop over the paged KV cache.

- `engine`     `Engine`: submit / abort / step / start / shutdown; `RequestHandle`, its errors.
- `scheduler`  `schedule`: decode tokens first, then their speculative drafts, then prefill chunks, under the budget.
- `speculative` drafts from the request's own tokens and its session's earlier outputs (`Drafter`).
- `runner`     `ModelRunner`: the model and its KV pool (loaded, and on a fault reloaded, as one); each step's forward.
- `output`     a sampled token → its `TokenEvent`: finish reason, detokenised and stop-trimmed text, logprobs.
- `sequence`   `Request` (what rides through admission) and `Sequence` (a running request).
- `stream`     `RequestStream`, `TokenEvent`: per-request events for threads and asyncio.
- `faults`     `ModelHealth` (the model's state), `FaultInjector` (`HELEXA_FAULT_INJECT`).
- `core`       `EngineClient`: the engine in its own process (`HELEXA_ENGINE_PROCESS`); `start_engine` picks.
"""

from helexa.config import EngineConfig
from helexa.engine.core import EngineClient, ServingEngine, start_engine
from helexa.engine.engine import (
    DeviceFault,
    Engine,
    EngineClosed,
    EngineCounters,
    EngineError,
    RequestFailed,
    RequestHandle,
)
from helexa.engine.faults import MODEL_STATES, ModelHealth
from helexa.engine.scheduler import ScheduledChunk, schedule
from helexa.engine.stream import RequestStream, TokenEvent, TokenLogprob

__all__ = [
    "MODEL_STATES",
    "DeviceFault",
    "Engine",
    "EngineClosed",
    "EngineConfig",
    "EngineCounters",
    "EngineClient",
    "EngineError",
    "ModelHealth",
    "RequestFailed",
    "RequestHandle",
    "RequestStream",
    "ScheduledChunk",
    "ServingEngine",
    "TokenEvent",
    "TokenLogprob",
    "schedule",
    "start_engine",
]
