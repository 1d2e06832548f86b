"""`SamplingParams`: what one request asks of the sampler, validated at construction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from helexa.values import is_int, is_number

__all__ = ["MAX_LOGIT_BIAS", "MAX_LOGPROBS", "SamplingParams"]

MAX_LOGPROBS = 20  # most top-n logprobs a request may ask for (OpenAI's limit)
MAX_LOGIT_BIAS = 100.0  # a bias is in [-100, 100] (OpenAI's range)
_TOP_K_MAX = 2**31 - 1  # larger values mean "all tokens" anyway, and must fit a device integer
_GREEDY_EPS = 1e-5  # temperatures below this are greedy (dividing by them would overflow)
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


def _is_bias(value: object) -> bool:
    """A number (not a bool) in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]; NaN and integers too large for a float are not."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) <= MAX_LOGIT_BIAS


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler (vLLM's names and defaults).

    `max_tokens` defaults to 16, as vLLM's `SamplingParams` does; None lets admission decide (what is
    left of the context after the prompt, at most the node's `default_max_tokens`). `top_k` of -1 or 0 disables
    it. `stop` accepts a string or a list and is stored as a tuple; `stop_token_ids` likewise.
    `logprobs`: None for none, 0 for the chosen token's logprob only, n ≤ 20 for it plus the top n.
    `grammar`: an llguidance grammar the output must follow (`grammar.json_schema_grammar(schema)`
    makes one from a JSON schema); None for free text. `skip_special_tokens`: whether the output text
    leaves out special tokens (as vLLM; a tool-call format whose marker is one needs them kept).
    `logit_bias`: token id → a bias in [-100, 100] added to that token's logit before sampling (OpenAI's
    semantics: -100 bans the token, 100 all but forces it); logprobs are taken before it.
    `speculative`: False opts this request out of the engine's speculative decoding (which never
    changes its tokens, only how many one step produces).
    Every field is checked in `__post_init__`; a bad value raises ValueError naming the field.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | Sequence[str] = ()  # None is also accepted, as () (both are stored as tuples)
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    grammar: str | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    speculative: bool = True

    def __post_init__(self) -> None:
        def bad(field: str, expected: str) -> ValueError:
            return ValueError(f"{field} must be {expected}, got {getattr(self, field)!r}")

        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "None or an integer >= 1")
        if not is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", "a finite number >= 0")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if not is_int(self.top_k) or not -1 <= self.top_k <= _TOP_K_MAX:
            raise bad("top_k", f"-1 or 0 (disabled) or an integer in [1, {_TOP_K_MAX}]")
        if not is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "in [0, 1]")
        if self.seed is not None and (not is_int(self.seed) or not _SEED_MIN <= self.seed <= _SEED_MAX):
            raise bad("seed", "None or a 64-bit integer")
        for field in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, field)
            if not is_number(value) or not -2 <= value <= 2:
                raise bad(field, "in [-2, 2]")
        if not is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "a finite number > 0")
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise bad("stop", "a non-empty string or a list of non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))
        stop_ids = () if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(stop_ids, (list, tuple)) or not all(is_int(t) and t >= 0 for t in stop_ids):
            raise bad("stop_token_ids", "a list of non-negative token ids")
        object.__setattr__(self, "stop_token_ids", tuple(stop_ids))
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "a boolean")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]")
        if not is_int(self.n) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar):
            raise bad("grammar", "None or a non-empty grammar string")
        if not isinstance(self.skip_special_tokens, bool):
            raise bad("skip_special_tokens", "a boolean")
        if not isinstance(self.speculative, bool):
            raise bad("speculative", "a boolean")
        if self.logit_bias is not None and not (
            isinstance(self.logit_bias, dict)
            and all(is_int(t) and t >= 0 for t in self.logit_bias)
            and all(_is_bias(v) for v in self.logit_bias.values())
        ):
            raise bad(
                "logit_bias", f"None or a map of token ids to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
            )

    @property
    def is_greedy(self) -> bool:  # temperature 0 (below 1e-5): the argmax, no randomness
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:  # any of the presence, frequency or repetition penalties is active
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def runs_to_limit(self) -> bool:  # nothing can end it before max_tokens: EOS ignored, no stop condition
        return self.ignore_eos and not self.stop and not self.stop_token_ids

    @property
    def takes_argmax(self) -> bool:  # its token is the raw logits' argmax, and nothing else of them is wanted
        return (
            self.is_greedy
            and self.logprobs is None
            and not self.uses_penalties
            and not self.logit_bias
            and self.grammar is None
        )

    @property
    def uses_filters(self) -> bool:  # any of top-k, top-p or min-p is active
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0
