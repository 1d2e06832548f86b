"""helexa.admission: block-exact admission — two gates, one FIFO queue, deadlines, estimated Retry-After.

Module map:
- `config`     `AdmissionConfig`: pool geometry, gates, queue limit, deadline, policy.
- `controller` `AdmissionController`: submit / poll / progress / release / cancel, snapshot, integrity.
- `estimator`  `EngineRates` and the FIFO simulation behind every wait estimate.
- `ticket`     `Ticket`, `TicketState`, `PollResult`: a request's place in admission.
- `errors`     `AdmissionRejected` (reason, HTTP status, OpenAI code, Retry-After, arithmetic).
"""

from helexa.admission.config import DEFAULT_MAX_TOKENS, DEFAULT_MAX_WAIT_SECS, AdmissionConfig
from helexa.admission.controller import MODEL_STATES, REJECTION_REASONS, AdmissionController, AdmissionObserver
from helexa.admission.errors import REJECTIONS, AdmissionIntegrityError, AdmissionRejected
from helexa.admission.estimator import EngineRates, FifoPlan, SeqWork, estimate_starts, retry_after_seconds
from helexa.admission.ticket import PollResult, Ticket, TicketState

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_MAX_WAIT_SECS",
    "MODEL_STATES",
    "REJECTIONS",
    "REJECTION_REASONS",
    "AdmissionConfig",
    "AdmissionController",
    "AdmissionIntegrityError",
    "AdmissionObserver",
    "AdmissionRejected",
    "EngineRates",
    "FifoPlan",
    "PollResult",
    "SeqWork",
    "Ticket",
    "TicketState",
    "estimate_starts",
    "retry_after_seconds",
]
