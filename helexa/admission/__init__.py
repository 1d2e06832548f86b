"""helexa.admission: block-exact admission — two gates, one FIFO queue, deadlines, estimated Retry-After.

- `controller`  `AdmissionController`, `Capacity`: submit / poll / progress / release / cancel, snapshot, integrity.
- `ticket`      `Ticket`, `TicketState`, `PollResult`: a request's place in admission.
- `estimator`   `FifoPlan`: the FIFO simulation behind every wait estimate; `retry_after_seconds`.
- `lengths`     `AnswerLengths`: learned answer lengths, the expected output each estimate plans with.
- `rates`       `EngineRates`, `RateTracker`: the engine's measured speed the estimates use.
- `rejections`  `AdmissionRejected` (reason, message with the numbers, Retry-After, arithmetic).
- `sharing`     `PrefixSharing`: what admission asks a prefix cache (hits at grant, orphans, block states).

Plain Python, no torch. Its configuration is `helexa.config.AdmissionConfig`.
"""

from helexa.admission.controller import AdmissionController, Capacity
from helexa.admission.estimator import FifoPlan, retry_after_seconds
from helexa.admission.lengths import AnswerLengths
from helexa.admission.rates import EngineRates, RateTracker
from helexa.admission.rejections import REJECTION_REASONS, AdmissionIntegrityError, AdmissionRejected
from helexa.admission.sharing import BlockStates, PrefixSharing, Share
from helexa.admission.ticket import PollResult, Ticket, TicketState
from helexa.config import AdmissionConfig

__all__ = [
    "REJECTION_REASONS",
    "AdmissionConfig",
    "AdmissionController",
    "AdmissionIntegrityError",
    "AdmissionRejected",
    "AnswerLengths",
    "BlockStates",
    "Capacity",
    "EngineRates",
    "FifoPlan",
    "PollResult",
    "PrefixSharing",
    "RateTracker",
    "Share",
    "Ticket",
    "TicketState",
    "retry_after_seconds",
]
