"""Sampling: per-request parameters and one vectorised sampling call per step.

`SamplingParams` is what a request asks for; `Sampler.sample` turns a step's logits `[S, V]` into
one token per row, applying per row, in this order:

1. logprobs, if asked: `log_softmax` of the **raw** logits — the model's own distribution, before
   penalties, temperature and filtering (what OpenAI clients expect; vLLM's "raw_logprobs");
2. penalties — repetition (prompt and output tokens: a positive logit is divided by the penalty, a
   negative one multiplied, as in Hugging Face and vLLM), then frequency (`-= f * count`) and
   presence (`-= p * [count > 0]`), both over output tokens only, as OpenAI defines them;
3. greedy rows (temperature < 1e-5) take the argmax of the penalised logits;
4. other rows: divide by temperature, then top-k (exactly k tokens survive; ties at the k-th value
   are broken by token id), then top-p (the smallest set of most-likely tokens whose probability,
   renormalised after top-k, reaches top_p), then min-p (tokens below `min_p × max probability`
   dropped), then sample.

Sampling inverts the CDF: one uniform `u` per row, and the first token whose cumulative probability
exceeds `u × total` (a token of probability 0 can never be picked). A row with its own
`torch.Generator` (a seeded request) draws its `u` from it and from nothing else, so a seeded
request produces the same tokens whatever else is in the batch; unseeded rows share the device's
default generator. One draw per row, not one per vocabulary entry, keeps sampling a few
milliseconds on a CPU.

The whole step is tensor math over the batch with a single device→host transfer at the end (the
sampled ids, packed with the logprobs when any row asked for them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["MAX_LOGPROBS", "SampleResult", "Sampler", "SamplingParams", "make_generator"]

MAX_LOGPROBS = 20  # most top-n logprobs a request may ask for (OpenAI's limit)
_TOP_K_MAX = 2**31 - 1  # larger values mean "all tokens" anyway, and must fit a device integer
_CANDIDATES = 1024  # tokens per row the filters examine before falling back to a full sort
_GREEDY_EPS = 1e-5  # temperatures below this are greedy (dividing by them would overflow)
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler (vLLM's names and defaults).

    `max_tokens` defaults to 16, as vLLM's `SamplingParams` does; the server resolves an OpenAI
    request without `max_tokens` to the context left after the prompt. `top_k` of -1 or 0 disables
    it. `stop` accepts a string or a list and is stored as a tuple; `stop_token_ids` likewise.
    `logprobs`: None for none, 0 for the chosen token's logprob only, n ≤ 20 for it plus the top n.
    Every field is checked in `__post_init__`; a bad value raises ValueError naming the field.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | Sequence[str] | None = ()
    stop_token_ids: Sequence[int] | None = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1

    def __post_init__(self) -> None:
        def bad(field: str, expected: str) -> ValueError:
            return ValueError(f"{field} must be {expected}, got {getattr(self, field)!r}")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "an integer >= 1")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", "a finite number >= 0")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= _TOP_K_MAX:
            raise bad("top_k", f"-1 or 0 (disabled) or an integer in [1, {_TOP_K_MAX}]")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "in [0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not _SEED_MIN <= self.seed <= _SEED_MAX):
            raise bad("seed", "None or a 64-bit integer")
        for field in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, field)
            if not _is_number(value) or not -2 <= value <= 2:
                raise bad(field, "in [-2, 2]")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "a finite number > 0")
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise bad("stop", "a non-empty string or a list of non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))
        stop_ids = () if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(stop_ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in stop_ids):
            raise bad("stop_token_ids", "a list of non-negative token ids")
        object.__setattr__(self, "stop_token_ids", tuple(stop_ids))
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "a boolean")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]")
        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "an integer >= 1")

    @property
    def is_greedy(self) -> bool:
        """Temperature 0 (below 1e-5): the argmax, no randomness."""
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        """Any of the presence, frequency or repetition penalties is active."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def uses_filters(self) -> bool:
        """Any of top-k, top-p or min-p is active."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A `torch.Generator` on `device` seeded with `seed`: one per seeded request, kept for its lifetime."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass(frozen=True)
class SampleResult:
    """One step's sampled tokens, per row.

    `logprobs[i]`: the chosen token's logprob under the raw model distribution, or None when row i
    did not ask for logprobs. `top_logprobs[i]`: `(token_id, logprob)` for the row's top n tokens,
    most likely first (empty for `logprobs=0`), or None when not asked.
    """

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


def _token_counts(rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """`[S, V]` float32 counts of each token id per row, via one scatter_add over padded ids."""
    width = max((len(r) for r in rows), default=0)
    padded = torch.full((len(rows), max(width, 1)), vocab_size, dtype=torch.int64)  # (S, L) on host; pad = V
    for i, row in enumerate(rows):
        if row:
            padded[i, : len(row)] = torch.as_tensor(row, dtype=torch.int64)
    if width and (int(padded.min()) < 0 or int(padded.max()) > vocab_size):
        raise ValueError(f"penalty token ids must be in [0, {vocab_size}) (the logits' vocabulary)")
    padded = padded.to(device, non_blocking=True)
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.float32, device=device)  # (S, V+1)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]  # (S, V): the padding column dropped


class Sampler:
    """Stateless: `sample` may be called from one engine thread per step (no state between calls)."""

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None = None,
        prompt_ids: Sequence[Sequence[int]] | None = None,
        output_ids: Sequence[Sequence[int]] | None = None,
    ) -> SampleResult:
        """Sample one token per row of `logits` `[S, V]` float32 under `params[i]`.

        `generators[i]` (on the logits' device) drives row i's randomness when given; seeded requests
        must pass one (see `make_generator`). `prompt_ids[i]` and `output_ids[i]` (host lists) are
        needed only for rows with penalties. Synchronises with the device once, to return the ids.
        """
        rows, vocab = self._check(logits, params, generators)
        generators = list(generators) if generators is not None else [None] * rows
        device = logits.device
        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None  # (S, V)

        if any(p.uses_penalties for p in params):
            logits = self._apply_penalties(logits, params, prompt_ids, output_ids)
        greedy = [p.is_greedy for p in params]
        if all(greedy):
            sampled = logits.argmax(dim=-1)  # (S,)
        else:
            temperature = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], device=device)
            scaled = logits / temperature[:, None]  # (S, V)
            if any(p.uses_filters for p, g in zip(params, greedy) if not g):
                scaled = self._apply_filters(scaled, params)
            probs = torch.softmax(scaled, dim=-1)  # (S, V); filtered tokens have probability 0
            cdf = probs.cumsum(dim=-1)  # (S, V)
            target = self._uniforms(rows, greedy, generators, device)[:, None] * cdf[:, -1:]  # (S, 1)
            sampled = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_max_(vocab - 1)  # (S,)
            if any(greedy):
                is_greedy = torch.tensor(greedy, device=device)
                sampled = torch.where(is_greedy, logits.argmax(dim=-1), sampled)  # (S,)
        return self._to_host(sampled, raw_logprobs, params)

    @staticmethod
    def _check(
        logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None] | None
    ) -> tuple[int, int]:
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.dtype != torch.float32:
            raise ValueError("logits must be a [S, V] float32 tensor")
        rows, vocab = logits.shape
        if len(params) != rows:
            raise ValueError(f"got {len(params)} SamplingParams for {rows} rows of logits")
        if generators is not None:
            if len(generators) != rows:
                raise ValueError(f"got {len(generators)} generators for {rows} rows of logits")
            for i, g in enumerate(generators):
                if g is not None and g.device.type != logits.device.type:
                    raise ValueError(f"generator {i} is on {g.device}, the logits on {logits.device}")
        for i, p in enumerate(params):
            if p.seed is not None and not p.is_greedy and (generators is None or generators[i] is None):
                raise ValueError(f"row {i} has seed={p.seed} but no generator (create one with make_generator)")
        return rows, vocab

    @staticmethod
    def _apply_penalties(
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]] | None,
        output_ids: Sequence[Sequence[int]] | None,
    ) -> torch.Tensor:
        rows, vocab = logits.shape
        device = logits.device
        needs = [p.uses_penalties for p in params]
        if output_ids is None or len(output_ids) != rows:
            raise ValueError("penalties need output_ids: one list of generated token ids per row")
        out_counts = _token_counts([ids if n else () for ids, n in zip(output_ids, needs)], vocab, device)  # (S, V)
        repetition = [p.repetition_penalty for p in params]
        if any(r != 1 for r in repetition):
            if prompt_ids is None or len(prompt_ids) != rows:
                raise ValueError("repetition_penalty needs prompt_ids: one list of prompt token ids per row")
            rep_rows = [ids if r != 1 else () for ids, r in zip(prompt_ids, repetition)]
            seen = (_token_counts(rep_rows, vocab, device) > 0) | (out_counts > 0)  # (S, V) bool
            penalty = torch.tensor(repetition, device=device)[:, None]  # (S, 1)
            penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, penalised, logits)
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]  # (S, 1)
        presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]  # (S, 1)
        return logits - frequency * out_counts - presence * (out_counts > 0).float()

    @staticmethod
    def _apply_filters(scaled: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Top-k, then top-p, then min-p, in sorted order; dropped tokens become -inf.

        Fast path (CPU): the filters run on the `_CANDIDATES` best tokens of each row (one `topk`,
        not a full sort of the vocabulary). A row takes it only when that is provably exact — its last
        candidate is dropped and lies strictly below every kept token, so every token outside the
        candidates would be dropped too; other rows go through the full sort. Rows without filters
        are returned unchanged.
        """
        rows, vocab = scaled.shape
        filtered = [p.uses_filters for p in params]
        k = min(vocab, max([_CANDIDATES] + [p.top_k for p in params]))
        if k >= vocab or scaled.device.type != "cpu":  # accelerators sort fast, and the check would sync
            return _filter_sorted_rows(scaled, params, filtered)
        values, ids = scaled.topk(k, dim=-1)  # (S, K), descending
        # Top-p without top-k measures mass against the whole vocabulary: only then is the full
        # log-sum-exp needed (a pass over `[S, V]`).
        needs_full = any(p.top_p < 1 and not 0 < p.top_k <= k for p in params)
        full_lse = scaled.logsumexp(dim=-1) if needs_full else None  # (S,)
        ids, perm = ids.sort(dim=-1)  # ties broken by token id, as the full stable sort does
        values, order = values.gather(1, perm).sort(dim=-1, descending=True, stable=True)
        ids = ids.gather(1, order)
        kept = _filter_sorted(values, params, full_lse)  # (S, K)
        alive = kept > -math.inf
        min_kept = torch.where(alive, kept, torch.full_like(kept, math.inf)).amin(dim=-1)  # (S,)
        exact = ~alive[:, -1] & (min_kept > values[:, -1])  # (S,) bool
        out = torch.full_like(scaled, -math.inf).scatter_(1, ids, kept)  # (S, V)
        flags = (exact.tolist() if any(filtered) else [True] * rows)
        slow = [i for i in range(rows) if filtered[i] and not flags[i]]
        passthrough = [i for i in range(rows) if not filtered[i]]
        if passthrough:
            out[passthrough] = scaled[passthrough]
        if slow:
            out[slow] = _filter_sorted_rows(scaled[slow], [params[i] for i in slow], [True] * len(slow))
        return out

    @staticmethod
    def _uniforms(
        rows: int, greedy: list[bool], generators: list[torch.Generator | None], device: torch.device
    ) -> torch.Tensor:
        """`[S]` draws from U[0, 1): seeded rows from their own generator, the rest from the default one."""
        draws = torch.empty(rows, device=device)  # (S,)
        own = [i for i in range(rows) if generators[i] is not None and not greedy[i]]
        if len(own) < rows:
            draws.uniform_()
        for i in own:
            draws[i : i + 1].uniform_(generator=generators[i])
        return draws

    @staticmethod
    def _to_host(
        sampled: torch.Tensor, raw_logprobs: torch.Tensor | None, params: Sequence[SamplingParams]
    ) -> SampleResult:
        rows = sampled.shape[0]
        if raw_logprobs is None:
            return SampleResult(sampled.tolist(), [None] * rows, [None] * rows)
        top_n = max(p.logprobs or 0 for p in params)
        chosen = raw_logprobs.gather(1, sampled[:, None])  # (S, 1)
        parts = [sampled[:, None].double(), chosen.double()]
        if top_n:
            top_values, top_ids = raw_logprobs.topk(top_n, dim=-1)  # (S, n) each
            parts += [top_ids.double(), top_values.double()]
        # One transfer: ids travel as float64, exact for any vocabulary below 2**53.
        packed = torch.cat(parts, dim=1).tolist()  # (S, 2 + 2n)
        token_ids, logprobs, top_logprobs = [], [], []
        for p, row in zip(params, packed):
            token_ids.append(int(row[0]))
            if p.logprobs is None:
                logprobs.append(None)
                top_logprobs.append(None)
                continue
            logprobs.append(row[1])
            ids, values = row[2 : 2 + top_n], row[2 + top_n :]
            top_logprobs.append([(int(ids[j]), values[j]) for j in range(p.logprobs)])
        return SampleResult(token_ids, logprobs, top_logprobs)


def _filter_sorted(sorted_logits: torch.Tensor, params: Sequence[SamplingParams], full_lse: torch.Tensor | None
                   ) -> torch.Tensor:
    """Apply top-k, top-p, min-p to logits sorted descending per row (`[S, N]`); dropped become -inf.

    `full_lse` (`[S]`) is each row's log-sum-exp over the whole vocabulary when `N` is only the
    best candidates: top-p then measures probability against the full distribution (renormalised
    after top-k, as when every token is present).
    """
    rows, n = sorted_logits.shape
    device = sorted_logits.device
    position = torch.arange(n, device=device)[None, :]  # (1, N)
    has_top_k = torch.tensor([0 < p.top_k <= n for p in params], device=device)  # (S,)
    if any(p.top_k > 0 for p in params):
        k = torch.tensor([p.top_k if p.top_k > 0 else n for p in params], device=device)[:, None]  # (S, 1)
        sorted_logits = sorted_logits.masked_fill(position >= k, -math.inf)
    if any(p.top_p < 1 for p in params):
        top_p = torch.tensor([p.top_p if p.top_p < 1 else math.inf for p in params], device=device)[:, None]
        lse = sorted_logits.logsumexp(dim=-1)  # (S,): the top-k renormalisation
        if full_lse is not None:
            lse = torch.where(has_top_k, lse, full_lse)
        probs = (sorted_logits - lse[:, None]).exp()  # (S, N)
        mass_before = probs.cumsum(dim=-1) - probs  # (S, N): probability of the tokens ranked above
        drop = (mass_before >= top_p) & (position > 0)  # the most likely token always survives
        sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
    if any(p.min_p > 0 for p in params):
        log_min_p = torch.tensor([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params],
                                 device=device)[:, None]  # (S, 1)
        # p_i < min_p * p_max  <=>  logit_i - logit_max < log(min_p): no renormalisation needed.
        sorted_logits = sorted_logits.masked_fill(sorted_logits - sorted_logits[:, :1] < log_min_p, -math.inf)
    return sorted_logits


def _filter_sorted_rows(scaled: torch.Tensor, params: Sequence[SamplingParams], filtered: Sequence[bool]
                        ) -> torch.Tensor:
    """The filters over a full stable sort of each row (ties by token id); rows not `filtered` unchanged."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # (S, V) each
    kept = _filter_sorted(sorted_logits, params, None)
    out = torch.empty_like(scaled).scatter_(1, order, kept)  # back to vocabulary order
    unfiltered = [i for i, f in enumerate(filtered) if not f]
    if unfiltered:
        out[unfiltered] = scaled[unfiltered]
    return out
