"""helexa.engine: the continuous-batching loop over the paged KV cache.

- `engine`     `Engine`: submit / abort / step / start / shutdown.
- `interface`  what an engine hands the server, in-process or not: `RequestHandle`, `EngineCounters`, the errors.
- `scheduler`  `schedule`: decode tokens first, then their speculative drafts, then prefill chunks, under the budget.
- `speculative` drafts from the request's own tokens and its session's earlier outputs (`Drafter`).
- `runner`     `ModelRunner`: the model and its KV pool (loaded, and on a fault reloaded, as one); each step's forward.
- `output`     a sampled token → its `TokenEvent`: finish reason, detokenised and stop-trimmed text, logprobs.
- `sequence`   `Request` (what rides through admission) and `Sequence` (a running request).
- `stream`     `RequestStream`, `TokenEvent`: per-request events; `Wakeups`: a batch of puts, one wake-up a loop;
               `StreamReader`: many streams read on one loop, a batch at a time.
- `faults`     `ModelHealth` (the model's state), `FaultInjector` (`HELEXA_FAULT_INJECT`).
- `core`       `EngineClient`: the engine in its own process (`HELEXA_ENGINE_PROCESS`); `start_engine` picks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from helexa.lazy import lazy_attributes

# Each name is imported from its module when first read, so that importing a light one (the server's side of
# the engine core, `EngineClient`, its events and errors) does not import torch and the model with `Engine`.
_HOME = {
    "MODEL_STATES": "helexa.engine.faults",
    "ModelHealth": "helexa.engine.faults",
    "DeviceFault": "helexa.engine.interface",
    "EngineClosed": "helexa.engine.interface",
    "EngineCounters": "helexa.engine.interface",
    "EngineError": "helexa.engine.interface",
    "RequestFailed": "helexa.engine.interface",
    "RequestHandle": "helexa.engine.interface",
    "Engine": "helexa.engine.engine",
    "EngineConfig": "helexa.config",
    "EngineClient": "helexa.engine.core",
    "ServingEngine": "helexa.engine.core",
    "start_engine": "helexa.engine.core",
    "ScheduledChunk": "helexa.engine.scheduler",
    "schedule": "helexa.engine.scheduler",
    "RequestStream": "helexa.engine.stream",
    "TokenEvent": "helexa.engine.stream",
    "TokenLogprob": "helexa.engine.stream",
    "StreamReader": "helexa.engine.stream",
    "Wakeups": "helexa.engine.stream",
}

if TYPE_CHECKING:
    from helexa.config import EngineConfig
    from helexa.engine.core import EngineClient, ServingEngine, start_engine
    from helexa.engine.engine import Engine
    from helexa.engine.faults import MODEL_STATES, ModelHealth
    from helexa.engine.interface import (
        DeviceFault,
        EngineClosed,
        EngineCounters,
        EngineError,
        RequestFailed,
        RequestHandle,
    )
    from helexa.engine.scheduler import ScheduledChunk, schedule
    from helexa.engine.stream import RequestStream, StreamReader, TokenEvent, TokenLogprob, Wakeups


__getattr__ = lazy_attributes(__name__, _HOME)


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
    "StreamReader",
    "TokenEvent",
    "TokenLogprob",
    "Wakeups",
    "schedule",
    "start_engine",
]
