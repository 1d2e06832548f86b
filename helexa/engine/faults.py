"""Simulated device faults for tests (`HELEXA_FAULT_INJECT=N[,M...]`): raised at those engine steps, once each."""

from __future__ import annotations

import os

INJECTED_FAULT_TEXT = "injected device fault"


class InjectedDeviceFault(RuntimeError):
    """A simulated device error; the engine treats it exactly like a real one."""


class FaultInjector:
    """Raises `InjectedDeviceFault` when `check(step)` is called with a listed step number (counted from 1).

    Each listed step faults once. Malformed lists raise `ValueError` at construction, naming the
    variable, so a typo never silently disables the test.
    """

    def __init__(self, steps: set[int] | None = None) -> None:
        self.pending = set(steps or ())

    @classmethod
    def from_env(cls, value: str | None = None) -> "FaultInjector":
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
