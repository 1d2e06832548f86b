"""helexa.engine.core: the engine core in its own process (the server's default; `HELEXA_ENGINE_PROCESS=0` opts out).

- `client`   `EngineClient`: the server's side; starts, supervises and restarts the core, replays streams.
- `process`  `CoreServer`, `main`: the core process's side (`python -m helexa.engine.core`).
- `wire`     the channel's encoding: typed values <-> plain trees (`to_plain`, `from_plain`), `marshal` frames.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

from helexa.config import EngineConfig
from helexa.engine.core.client import CoreDied, EngineClient, engine_process_enabled

if TYPE_CHECKING:  # `Engine` (torch, the model) is imported only to run one in this process
    from helexa.engine.engine import Engine

__all__ = ["CoreDied", "EngineClient", "ServingEngine", "engine_process_enabled", "start_engine"]

ServingEngine: TypeAlias = "Engine | EngineClient"  # what the server serves: the engine in this process, or in its own


def start_engine(config: EngineConfig, in_process: bool | None = None) -> ServingEngine:
    """A started engine for the server: in its own process when `in_process` is False (None: as
    `HELEXA_ENGINE_PROCESS` says, its own process when unset), else in this one, its loop on a thread."""
    if in_process is None:
        in_process = not engine_process_enabled()
    if not in_process:
        return EngineClient(config)
    from helexa.engine.engine import Engine

    engine = Engine(config)
    engine.start()
    return engine
