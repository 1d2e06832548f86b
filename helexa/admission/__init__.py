"""helexa.admission: block-exact admission — two gates, one FIFO queue, deadlines, estimated Retry-After.

- `controller`  `AdmissionController`, `Capacity`: submit / poll / progress / release / cancel, snapshot, integrity.
- `ticket`      `Ticket`, `TicketState`, `PollResult`: a request's place in admission.
- `estimator`   `FifoPlan`: the FIFO simulation behind every wait estimate; `retry_after_seconds`.
- `lengths`     `AnswerLengths`: learned answer lengths, the expected output each estimate plans with.
- `rates`       `EngineRates`, `RateTracker`: the engine's measured speed the estimates use.
- `rejections`  `AdmissionRejected` (reason, message with the numbers, Retry-After, arithmetic).

Plain Python, no torch. Its configuration is `helexa.config.AdmissionConfig`; what it asks the KV owner
(who holds which block) is the `KVHoldings` protocol of `helexa.kvprotocol`.
"""

from helexa.admission.controller import AdmissionController, Capacity
from helexa.admission.estimator import FifoPlan, retry_after_seconds
from helexa.admission.lengths import AnswerLengths
from helexa.admission.rates import EngineRates, RateTracker
from helexa.admission.rejections import REJECTION_REASONS, AdmissionIntegrityError, AdmissionRejected
from helexa.admission.ticket import PollResult, Ticket, TicketState
from helexa.config import AdmissionConfig

__all__ = [
    "REJECTION_REASONS",
    "AdmissionConfig",
    "AdmissionController",
    "AdmissionIntegrityError",
    "AdmissionRejected",
    "AnswerLengths",
    "Capacity",
    "EngineRates",
    "FifoPlan",
    "PollResult",
    "RateTracker",
    "Ticket",
    "TicketState",
    "retry_after_seconds",
]
