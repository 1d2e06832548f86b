"""helexa.engine.speculative: drafts for speculative decoding, from text the request and its session already hold.

- `ngram`     `NgramIndex`: prompt lookup, the tokens after the latest earlier occurrence of the last n tokens.
- `sessions`  `SessionOutputs`: an agent session's earlier outputs (by salt and prompt_cache_key), bounded.
- `drafter`   `Drafter`: each decoding request's draft and its adaptive length; `SpecStats`, the totals.

The verification is the runner's (`ModelRunner.execute`): it samples after each draft token and keeps
the draft up to the first token decoding alone would not have produced.
"""

from helexa.engine.speculative.drafter import SPECULATIVE_MODES, Drafter, DraftState, SpecStats
from helexa.engine.speculative.ngram import NgramIndex
from helexa.engine.speculative.sessions import SessionOutputs

__all__ = ["SPECULATIVE_MODES", "DraftState", "Drafter", "NgramIndex", "SessionOutputs", "SpecStats"]
