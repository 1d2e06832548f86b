"""Output processing: the finish reason of one sampled token."""

from __future__ import annotations

from helexa.engine.output import finish_reason
from helexa.model.sampling import SamplingParams


def test_finish_reason() -> None:
    eos = frozenset({2, 7})
    p = SamplingParams(stop_token_ids=[9])
    assert finish_reason(5, 1, 3, p, eos) is None
    assert finish_reason(2, 1, 3, p, eos) == "stop"
    assert finish_reason(9, 1, 3, p, eos) == "stop"
    assert finish_reason(5, 3, 3, p, eos) == "length"
    assert finish_reason(7, 3, 3, p, eos) == "stop"  # stop wins over length on the same token
    ignoring = SamplingParams(stop_token_ids=[9], ignore_eos=True)
    assert finish_reason(2, 1, 3, ignoring, eos) is None
    assert finish_reason(9, 1, 3, ignoring, eos) == "stop"  # explicit stop tokens still stop
    assert finish_reason(2, 3, 3, ignoring, eos) == "length"
    # the limit is the one admission decided, whatever the request's own max_tokens said
    assert finish_reason(5, 3, 3, SamplingParams(max_tokens=None), eos) == "length"
