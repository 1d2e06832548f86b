"""Device-fault recovery: log the fault with its cause, reload the model with backoff, or give up.

`FaultRecovery` decides and reloads; it knows nothing of the requests, nor of what it reloads beyond its
block count (`Loaded`): a `ModelRunner` in the engine, a whole engine core process in `EngineClient`.
The engine drops what lived in the old pool before it calls `recover` and replays its sequences
afterwards, so the two meet only at `recover`'s result: a fresh one with the same block count as the
first load, or the cause to give up with.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from helexa.engine.faults import ModelHealth
from helexa.heap import freeze_heap, thaw_heap, trim_heap
from helexa.kvcache import KVBudget

logger = logging.getLogger("helexa.engine")

__all__ = ["FaultRecovery", "Loaded", "Recovered"]


class Loaded(Protocol):
    """What a reload gives: something holding a KV pool of `budget.num_blocks` blocks, stopped by `close`."""

    @property
    def budget(self) -> KVBudget: ...

    def close(self, graceful: bool = True) -> None: ...


R = TypeVar("R", bound=Loaded)


@dataclass(frozen=True)
class Recovered(Generic[R]):
    """What `recover` gives: the reloaded `runner`, or None and the `cause` to give up with."""

    runner: R | None
    cause: str


class FaultRecovery(Generic[R]):
    """Counts consecutive device faults and reloads the model after each, until `max_retries` in a row fail.

    `load()` builds a new `ModelRunner` from the engine's config; `health` is the model's state, which
    this object moves (poisoned, reloading, loaded; the engine gives up for good). A reload that gives a
    block count other than `first_num_blocks` is a failure that keeps the node poisoned: the node never
    serves another budget than the one it started with.
    """

    def __init__(
        self,
        load: Callable[[], R],
        health: ModelHealth,
        *,
        first_num_blocks: int,
        max_retries: int,
        backoff_secs: float,
        device_type: str,
    ) -> None:
        self._load, self.health = load, health
        self.first_num_blocks, self.max_retries, self.backoff_secs = first_num_blocks, max_retries, backoff_secs
        self.device_type = device_type  # "cuda": the allocator's cached memory is emptied before a reload
        self.consecutive = 0
        self.faults = 0  # device faults since start, failed reloads included
        self.reloads = 0

    def succeeded(self) -> None:
        """A step ran on the device: the next fault is the first in a row again."""
        self.consecutive = 0

    def recover(self, exc: BaseException, where: str) -> Recovered[R]:
        """Handle one device fault (`where` describes the step for the log): the caller has already dropped
        the old runner. Reloads with exponential backoff; returns the new runner, or the cause to give up
        with once `max_retries` consecutive faults (failed reloads included) have happened."""
        self.faults += 1
        self.consecutive += 1
        cause = f"{type(exc).__name__}: {exc}"
        logger.error(f"engine: device fault at {where} (consecutive={self._count()}): {cause}", exc_info=exc)
        self.health.set("poisoned")
        if self.consecutive > self.max_retries:
            return Recovered(None, f"device fault not recovered after {self.max_retries} reloads: {cause}")
        self.health.set("reloading")
        backoff = self.backoff_secs * 2 ** (self.consecutive - 1)
        refreeze = False  # a server process froze its heap after load: it is frozen again after the reload
        while True:
            time.sleep(min(backoff, 30.0))
            refreeze = thaw_heap() > 0 or refreeze  # the old model and pool give their device memory back first
            if self.device_type == "cuda":
                import torch  # only an engine on a GPU gets here, and it has torch loaded

                torch.cuda.empty_cache()
            try:
                runner = self._load()
                break
            except Exception as load_exc:  # a failed reload is one more consecutive fault
                self.faults += 1
                self.consecutive += 1
                cause = f"{type(load_exc).__name__}: {load_exc}"
                logger.error(f"engine: reload failed (consecutive={self._count()}): {cause}", exc_info=load_exc)
                if self.consecutive > self.max_retries:
                    return Recovered(None, f"model reload failed {self.consecutive} times in a row: {cause}")
                backoff *= 2
        num_blocks = runner.budget.num_blocks
        if num_blocks != self.first_num_blocks:
            logger.error(
                f"engine: reload gave {num_blocks} KV blocks, first load {self.first_num_blocks}; staying poisoned"
            )
            runner.close(graceful=False)
            return Recovered(
                None,
                f"KV budget changed across reload ({self.first_num_blocks} -> {num_blocks} blocks) "
                f"after device fault: {cause}",
            )
        self.reloads += 1
        trim_heap("engine: reloaded")
        if refreeze:
            freeze_heap("engine: reloaded")
        self.health.set("loaded")
        return Recovered(runner, cause)

    def _count(self) -> str:
        return f"{self.consecutive}/{self.max_retries}"
