"""One vectorised sampling call per step: `Sampler.sample` turns logits `[S, V]` into one token per row.

Per row, in this order: (1) logprobs, if asked, are `log_softmax` of the **raw** logits (before
penalties, `logit_bias`, a grammar's mask, temperature and filters, as OpenAI clients expect: the
model's own distribution, so every logprob is finite); (2) penalties: repetition over prompt
and output tokens (a positive logit divided by it, a negative one multiplied, as Hugging Face and
vLLM do), then frequency (`-= f * count`) and presence (`-= p * [count > 0]`) over output tokens;
(2b) `logit_bias` is added to its tokens' logits; (2c) a structured-output grammar's mask sets the
tokens it forbids to -inf (`bitmask`); (3) greedy rows (temperature < 1e-5) take the argmax; (4)
other rows are divided by temperature, then top-k (exactly k survive, ties at the k-th value broken
by token id), top-p (the smallest set of most likely tokens whose probability, renormalised after
top-k, reaches top_p) and min-p (tokens below `min_p × max probability` dropped) apply, and one
uniform `u` per row picks the first token whose cumulative probability exceeds `u × total`. A seeded
row draws `u` from its own generator only (unseeded rows share the default one), so its tokens do
not depend on the rest of the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from helexa.model.quant import native
from helexa.model.sampling.bitmask import masked_logits
from helexa.model.sampling.params import SamplingParams

__all__ = ["SampleResult", "Sampler", "make_generator"]

_CANDIDATES = 1024  # tokens per row the filters examine before falling back to a full sort


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A `torch.Generator` on `device` seeded with `seed`: one per seeded request, kept for its lifetime."""
    return torch.Generator(device=device).manual_seed(seed)


@dataclass(frozen=True)
class SampleResult:
    """One step's sampled tokens per row; `logprobs[i]` (the chosen token's raw logprob) and
    `top_logprobs[i]` (`(token_id, logprob)` of the top n, most likely first; empty for `logprobs=0`)
    are None for rows that did not ask for logprobs."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


class Sampler:
    """Stateless: `sample` may be called from one engine thread per step (no state between calls).

    `native_argmax`: greedy rows of CPU logits take their token from helexa's native kernel
    (`native.argmax_rows`, which must be available: the same indices as torch's argmax, 5-7x as fast over a
    49k vocabulary); otherwise, and for logits elsewhere, from torch's argmax."""

    def __init__(self, native_argmax: bool = False) -> None:
        self._native_argmax = native_argmax

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None = None,
        prompt_ids: Sequence[Sequence[int]] | None = None,
        output_ids: Sequence[Sequence[int]] | None = None,
        bitmask: torch.Tensor | None = None,
    ) -> SampleResult:
        """One token per row of `logits` `[S, V]` float32 under `params[i]` (`logits` is not changed).
        `generators[i]` (on the logits' device; required for seeded rows, see `make_generator`) drives row
        i's randomness; `prompt_ids[i]`, `output_ids[i]` (host lists) are needed only for rows with
        penalties. `bitmask` `[S, W]` int32 on the host (`bitmask.allocate_bitmask`, filled by each
        constrained row's `TokenConstraint`): the tokens each row may sample; logprobs never see it."""
        rows, vocab = self._check(logits, params, generators)
        device = logits.device
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(p.logprobs is not None for p in params) else None
        if any(p.uses_penalties for p in params):
            logits = self._apply_penalties(logits, params, prompt_ids, output_ids)
        if any(p.logit_bias for p in params):
            logits = _with_bias(logits, params)
        if bitmask is not None:
            logits = masked_logits(logits, bitmask)
        greedy = [p.is_greedy for p in params]
        if all(greedy):
            sampled = self._argmax(logits)  # (S,)
        else:
            temperature = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], device=device)
            scaled = logits / temperature[:, None]  # (S, V)
            if any(p.uses_filters for p, g in zip(params, greedy) if not g):
                scaled = self._apply_filters(scaled, params)
            cdf = torch.softmax(scaled, dim=-1).cumsum(dim=-1)  # (S, V); filtered tokens add nothing
            # One uniform per row: seeded rows from their own generator, the rest from the default one.
            own = [(i, g) for i, g in enumerate(generators or [None] * rows) if g is not None and not greedy[i]]
            draws = torch.empty(rows, device=device)  # (S,)
            if len(own) < rows:
                draws.uniform_()
            for i, g in own:
                draws[i : i + 1].uniform_(generator=g)
            target = draws[:, None] * cdf[:, -1:]  # (S, 1)
            sampled = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_max_(vocab - 1)  # (S,)
            if any(greedy):
                sampled = torch.where(torch.tensor(greedy, device=device), self._argmax(logits), sampled)  # (S,)
        return self._to_host(sampled, raw_logprobs, params)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's argmax (S,) int64: the native kernel's where `native_argmax` and it takes these logits."""
        if self._native_argmax and logits.device.type == "cpu" and logits.stride(-1) == 1 and logits.shape[-1]:
            return native.argmax_rows(logits)
        return logits.argmax(dim=-1)

    @staticmethod
    def _check(
        logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None] | None
    ) -> tuple[int, int]:
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.dtype != torch.float32:
            raise ValueError("logits must be a [S, V] float32 tensor")
        rows, vocab = logits.shape
        if len(params) != rows:
            raise ValueError(f"got {len(params)} SamplingParams for {rows} rows of logits")
        if generators is not None and len(generators) != rows:
            raise ValueError(f"got {len(generators)} generators for {rows} rows of logits")
        for i, (p, g) in enumerate(zip(params, generators or [None] * rows)):
            if g is not None and g.device.type != logits.device.type:
                raise ValueError(f"generator {i} is on {g.device}, the logits on {logits.device}")
            if p.seed is not None and not p.is_greedy and g is None:
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
        if output_ids is None or len(output_ids) != rows:
            raise ValueError("penalties need output_ids: one list of generated token ids per row")
        needs = [p.uses_penalties for p in params]
        out_counts = _token_counts([ids if n else () for ids, n in zip(output_ids, needs)], vocab, device)  # (S, V)
        repetition = [p.repetition_penalty for p in params]
        if any(r != 1 for r in repetition):
            if prompt_ids is None or len(prompt_ids) != rows:
                raise ValueError("repetition_penalty needs prompt_ids: one list of prompt token ids per row")
            rep_rows = [ids if r != 1 else () for ids, r in zip(prompt_ids, repetition)]
            seen = (_token_counts(rep_rows, vocab, device) > 0) | (out_counts > 0)  # (S, V) bool
            penalty = torch.tensor(repetition, device=device)[:, None]  # (S, 1)
            logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]  # (S, 1)
        presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]  # (S, 1)
        return logits - frequency * out_counts - presence * (out_counts > 0).float()

    @staticmethod
    def _apply_filters(scaled: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Top-k, then top-p, then min-p; dropped tokens become -inf, rows without filters are unchanged.

        On CPU the filters first run on each row's `_CANDIDATES` best tokens (a `topk`, not a full sort),
        kept only where provably exact: the last candidate is dropped and lies strictly below every kept
        token, so every token outside would be dropped too. Other rows take the full sort."""
        rows, vocab = scaled.shape
        k = min(vocab, max([_CANDIDATES] + [p.top_k for p in params]))
        if k >= vocab or scaled.device.type != "cpu":  # accelerators sort fast, and the check would sync
            return _filter_sorted_rows(scaled, params)
        values, ids = scaled.topk(k, dim=-1)  # (S, K), descending
        # Only top-p without top-k measures mass against the whole vocabulary: a pass over `[S, V]`.
        needs_full = any(p.top_p < 1 and not 0 < p.top_k <= k for p in params)
        full_lse = scaled.logsumexp(dim=-1) if needs_full else None  # (S,)
        ids, perm = ids.sort(dim=-1)  # ties broken by token id, as the full stable sort does
        values, order = values.gather(1, perm).sort(dim=-1, descending=True, stable=True)
        kept = _filter_sorted(values, params, full_lse)  # (S, K)
        alive = kept > -math.inf
        min_kept = torch.where(alive, kept, math.inf).amin(dim=-1)  # (S,)
        exact = (~alive[:, -1] & (min_kept > values[:, -1])).tolist()  # (S,)
        out = torch.full_like(scaled, -math.inf).scatter_(1, ids.gather(1, order), kept)  # (S, V)
        unfiltered = [i for i, p in enumerate(params) if not p.uses_filters]
        slow = [i for i, p in enumerate(params) if p.uses_filters and not exact[i]]
        if unfiltered:
            out[unfiltered] = scaled[unfiltered]
        if slow:
            out[slow] = _filter_sorted_rows(scaled[slow], [params[i] for i in slow])
        return out

    @staticmethod
    def _to_host(
        sampled: torch.Tensor, raw_logprobs: torch.Tensor | None, params: Sequence[SamplingParams]
    ) -> SampleResult:
        rows = sampled.shape[0]
        if raw_logprobs is None:
            return SampleResult(sampled.tolist(), [None] * rows, [None] * rows)
        top_n = max(p.logprobs or 0 for p in params)
        parts = [sampled[:, None].double(), raw_logprobs.gather(1, sampled[:, None]).double()]
        if top_n:
            top_values, top_ids = raw_logprobs.topk(top_n, dim=-1)  # (S, n) each
            parts += [top_ids.double(), top_values.double()]
        # One transfer: ids travel as float64, exact for any vocabulary below 2**53.
        packed = torch.cat(parts, dim=1).tolist()  # (S, 2 + 2n)
        logprobs: list[float | None] = []
        top_logprobs: list[list[tuple[int, float]] | None] = []
        for p, row in zip(params, packed):
            logprobs.append(None if p.logprobs is None else row[1])
            top = None if p.logprobs is None else [(int(row[2 + j]), row[2 + top_n + j]) for j in range(p.logprobs)]
            top_logprobs.append(top)
        return SampleResult([int(row[0]) for row in packed], logprobs, top_logprobs)


def _with_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """`logits` `[S, V]` plus each row's `logit_bias` (a new tensor). A token id outside `[0, V)` raises
    ValueError (the request's own error)."""
    vocab = logits.shape[1]
    rows, ids, values = [], [], []
    for i, p in enumerate(params):
        for token_id, bias in (p.logit_bias or {}).items():
            if token_id >= vocab:
                raise ValueError(f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab})")
            rows.append(i)
            ids.append(token_id)
            values.append(bias)
    index = (torch.tensor(rows, device=logits.device), torch.tensor(ids, device=logits.device))
    return logits.index_put(index, torch.tensor(values, device=logits.device), accumulate=True)


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


def _filter_sorted(
    sorted_logits: torch.Tensor, params: Sequence[SamplingParams], full_lse: torch.Tensor | None
) -> torch.Tensor:
    """Top-k, top-p, min-p over logits sorted descending per row (`[S, N]`); dropped become -inf. When
    the N are only the best candidates, `full_lse` (`[S]`, the log-sum-exp over the whole vocabulary)
    lets top-p measure against the full distribution (renormalised after top-k, as always)."""
    n = sorted_logits.shape[1]
    device = sorted_logits.device
    position = torch.arange(n, device=device)[None, :]  # (1, N)
    if any(p.top_k > 0 for p in params):
        k = torch.tensor([p.top_k if p.top_k > 0 else n for p in params], device=device)[:, None]  # (S, 1)
        sorted_logits = sorted_logits.masked_fill(position >= k, -math.inf)
    if any(p.top_p < 1 for p in params):
        top_p = torch.tensor([p.top_p if p.top_p < 1 else math.inf for p in params], device=device)[:, None]
        lse = sorted_logits.logsumexp(dim=-1)  # (S,): the top-k renormalisation
        if full_lse is not None:
            lse = torch.where(torch.tensor([0 < p.top_k <= n for p in params], device=device), lse, full_lse)
        probs = (sorted_logits - lse[:, None]).exp()  # (S, N)
        mass_before = probs.cumsum(dim=-1) - probs  # (S, N): probability of the tokens ranked above
        drop = (mass_before >= top_p) & (position > 0)  # the most likely token always survives
        sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
    if any(p.min_p > 0 for p in params):
        log_min_p = [math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params]
        # p_i < min_p * p_max  <=>  logit_i - logit_max < log(min_p): no renormalisation needed.
        too_small = sorted_logits - sorted_logits[:, :1] < torch.tensor(log_min_p, device=device)[:, None]
        sorted_logits = sorted_logits.masked_fill(too_small, -math.inf)
    return sorted_logits


def _filter_sorted_rows(scaled: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The filters over a full stable sort of each row (ties by token id); rows without filters come
    back unchanged (sorting and scattering back moves no value)."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # (S, V) each
    return torch.empty_like(scaled).scatter_(1, order, _filter_sorted(sorted_logits, params, None))
