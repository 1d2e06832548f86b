"""Device faults: the model's health (its one home) and simulated faults for tests (`HELEXA_FAULT_INJECT`)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

MODEL_STATES = ("loaded", "reloading", "poisoned")
INJECTED_FAULT_TEXT = "injected device fault"


class ModelHealth:
    """Whether the model serves: `state` is `loaded`, `reloading` or `poisoned`; `fault_cause` says why it gave up.

    `reload_seconds_left()` is None while loaded; otherwise the estimated seconds until it serves
    again — what the last recovery took (fault to loaded) minus the time since this fault, or, before
    any recovery finished, as long again as this one has taken so far. Safe to read from any thread.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._since: float | None = None  # when the current fault began
        self.state = "loaded"
        self.fault_cause: str | None = None  # set when the node gives up for good
        self.last_reload_seconds: float | None = None

    def set(self, state: str) -> None:
        """Move to `state`; leaving `loaded` starts the recovery clock, returning to it stops it."""
        if state not in MODEL_STATES:
            raise ValueError(f"model state must be one of {MODEL_STATES}, got {state!r}")
        with self._lock:
            now = self._clock()
            if state != "loaded" and self._since is None:
                self._since = now
            elif state == "loaded" and self._since is not None:
                self.last_reload_seconds, self._since = now - self._since, None
            self.state = state

    def give_up(self, cause: str) -> None:
        """Poisoned for good, because of `cause`."""
        self.fault_cause = cause
        self.set("poisoned")

    def reload_seconds_left(self) -> float | None:
        with self._lock:
            if self.state == "loaded":
                return None
            elapsed = 0.0 if self._since is None else self._clock() - self._since
            return elapsed if self.last_reload_seconds is None else max(0.0, self.last_reload_seconds - elapsed)


class InjectedDeviceFault(RuntimeError):
    """A simulated device error; the engine treats it exactly like a real one."""


class FaultInjector:
    """Raises `InjectedDeviceFault` when `check(step)` is called with a listed step number (counted from 1), once each.

    A malformed list raises `ValueError` naming the variable, so a typo never silently disables a test.
    """

    def __init__(self, steps: set[int] | None = None) -> None:
        self.pending = set(steps or ())

    @classmethod
    def from_env(cls, value: str | None = None) -> FaultInjector:
        text = os.environ.get("HELEXA_FAULT_INJECT", "") if value is None else value
        steps: set[int] = set()
        for part in filter(None, (p.strip() for p in text.split(","))):
            if not part.isdigit() or int(part) < 1:
                raise ValueError(f"HELEXA_FAULT_INJECT must list step numbers >= 1 (e.g. '5,12'); got {text!r}")
            steps.add(int(part))
        return cls(steps)

    def check(self, step: int) -> None:
        """Raise the simulated fault if `step` is listed and has not faulted yet."""
        if step in self.pending:
            self.pending.discard(step)
            raise InjectedDeviceFault(f"{INJECTED_FAULT_TEXT} at engine step {step} (HELEXA_FAULT_INJECT)")
