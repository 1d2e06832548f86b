"""Output processing: one sampled token becomes a `TokenEvent` — finish reason, text (detokenised,
stop strings trimmed across token boundaries) and logprobs."""

from __future__ import annotations

from collections.abc import Collection

from helexa.engine.sequence import Sequence
from helexa.engine.stream import TokenEvent, TokenLogprob
from helexa.model.sampling import SampleResult, SamplingParams


def finish_reason(
    token_id: int, num_output_tokens: int, max_tokens: int, params: SamplingParams, eos_token_ids: Collection[int]
) -> str | None:
    """Why a sequence finishes after sampling `token_id` as its `num_output_tokens`-th token, or None.

    "stop": the token is in `params.stop_token_ids`, or is an EOS id and `params.ignore_eos` is
    False. "length": `num_output_tokens` reached `max_tokens`. A stop wins over length on the same token.
    """
    if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids):
        return "stop"
    return "length" if num_output_tokens >= max_tokens else None


def append_token(seq: Sequence, samples: SampleResult, row: int, eos_token_ids: Collection[int]) -> TokenEvent:
    """Append row `row`'s sampled token to `seq` and return its event (final when the sequence ends).

    A stop token or EOS is never shown; a stop string ends the text before it; at the length limit
    everything held back (incomplete bytes, a possible stop-string prefix) is released.
    """
    token = samples.token_ids[row]
    seq.token_ids.append(token)
    num_output, params = seq.num_output, seq.params
    reason = finish_reason(token, num_output, seq.granted_max_tokens, params, eos_token_ids)
    text = ""
    if reason != "stop":
        checker, delta = seq.stop_checker, seq.detokenizer.push(token)
        if not checker.watching:  # no stop strings (most requests): the text is the detokenizer's
            text = delta + seq.detokenizer.flush() if reason is not None else delta
        else:
            result = checker.feed(delta)
            text = result.emit
            if result.stopped:
                reason = "stop"
            elif reason is not None:
                text += checker.feed(seq.detokenizer.flush()).emit
                if not checker.stopped:
                    text += checker.flush()
    logprobs: tuple[TokenLogprob, ...] = ()
    if params.logprobs is not None:
        logprob = samples.logprobs[row]
        assert logprob is not None  # the sampler returns a logprob for every row that asked
        logprobs = (TokenLogprob(token, float(logprob), tuple(samples.top_logprobs[row] or ())),)
    return TokenEvent(
        token_ids=(token,),
        text=text,
        logprobs=logprobs,
        finish_reason=reason,
        num_prompt_tokens=seq.prompt_len,
        num_cached_tokens=seq.cached_tokens,
        num_output_tokens=num_output,
    )
