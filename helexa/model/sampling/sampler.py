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
uniform `u` per row picks the first token whose cumulative probability exceeds `u × total`: in rank
order for a filtered row on the CPU (its kept tokens are found among its best candidates), in token
order for the others. A seeded row draws `u` from its own generator only (unseeded rows share the
default one), so its tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from helexa.model.buffers import KeptBuffers
from helexa.model.quant import native
from helexa.model.sampling.bitmask import masked_logits
from helexa.model.sampling.params import SamplingParams

__all__ = ["SampleResult", "Sampler", "TokenIds", "make_generator"]

# One row's token ids for the penalties: a list of ints, or an int64 array its owner converted once.
TokenIds = Sequence[int] | np.ndarray

# Tokens per row the filters examine, smallest first (a row whose kept set is not provably inside its
# candidates tries the next size, then a full sort): on 16 rows of a 49k vocabulary a top-64 takes 0.6 ms,
# a top-1024 4 ms.
_CANDIDATES = (64, 1024)
# The sampler's (S, V) working buffers are kept between calls up to this size each (`helexa.model.buffers`).
_KEPT_WORK_BYTES = 16 << 20


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
    """Holds nothing between calls but its working buffers (each call overwrites what it reads): one thread
    calls `sample` at a time (the engine's, once a step).

    `native`: CPU logits go through helexa's native row kernels, which must be available: greedy rows take
    their token from `native.argmax_rows` (the same indices as torch's argmax, 5-7x as fast over a 49k
    vocabulary), rows without filters are drawn by `native.draw_rows`, a filtered row's first candidates
    (and the log-sum-exp top-p measures against) come from `native.logprobs_rows` / `native.top_rows`, and
    so do the logprobs (no (S, V) log-softmax written; within float32 precision of torch's); otherwise, and
    for logits elsewhere, torch's operations."""

    def __init__(self, native: bool = False) -> None:
        self._native = native
        self._work = KeptBuffers()  # the (S, V) working buffers, reused by the next call

    def _buffer(self, use: str, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """A (rows, cols) float32 working buffer for `use`, kept between calls up to `_KEPT_WORK_BYTES`."""
        return self._work.get(use, rows, cols, _KEPT_WORK_BYTES, device)

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None = None,
        prompt_ids: Sequence[TokenIds] | None = None,
        output_ids: Sequence[TokenIds] | None = None,
        bitmask: torch.Tensor | None = None,
    ) -> SampleResult:
        """One token per row of `logits` `[S, V]` float32 under `params[i]` (`logits` is not changed).
        `generators[i]` (on the logits' device; required for seeded rows, see `make_generator`) drives row
        i's randomness; `prompt_ids[i]`, `output_ids[i]` (host lists) are needed only for rows with
        penalties. `bitmask` `[S, W]` int32 on the host (`bitmask.allocate_bitmask`, filled by each
        constrained row's `TokenConstraint`): the tokens each row may sample; logprobs never see it."""
        rows, vocab = self._check(logits, params, generators)
        device = logits.device
        top_n = max(p.logprobs or 0 for p in params)
        raw_logprobs = self._raw_logprobs(logits, top_n) if any(p.logprobs is not None for p in params) else None
        penalised = any(p.uses_penalties for p in params)
        if penalised or any(p.logit_bias for p in params):
            logits = self._buffer("adjusted", rows, vocab, device).copy_(logits)  # changed in place below
            if penalised:
                scratch = self._buffer("counts", rows, vocab, device)
                _apply_penalties(logits, params, prompt_ids, output_ids, scratch)
            _add_bias(logits, params)
        if bitmask is not None:
            logits = masked_logits(logits, bitmask, self._buffer("masked", rows, vocab, device))
        greedy = [p.is_greedy for p in params]
        if all(greedy):
            sampled = self._argmax(logits)  # (S,)
        else:
            sampled = self._draw(logits, params, greedy, generators or [None] * rows)  # (S,)
            if any(greedy):
                sampled = torch.where(torch.tensor(greedy, device=device), self._argmax(logits), sampled)  # (S,)
        return self._to_host(sampled, raw_logprobs, params)

    def _takes_native(self, logits: torch.Tensor) -> bool:
        """Whether these logits go through the native row kernels: `native`, on the CPU, rows contiguous."""
        return self._native and logits.device.type == "cpu" and logits.stride(-1) == 1 and logits.shape[-1] > 0

    def _raw_logprobs(self, logits: torch.Tensor, top_n: int) -> _RawLogprobs:
        """The raw logits' log-probabilities, for `_to_host`: the native kernel's shift and top `top_n` where
        `native` and it takes these logits (and no row holds a NaN), else torch's whole `log_softmax` (into a
        kept buffer) and its `topk`."""
        rows, vocab = logits.shape
        if self._takes_native(logits):
            if top_n <= min(vocab, native.TOP_LOGPROBS_MAX):
                found = native.logprobs_rows(logits, top_n)
                if found is not None:
                    return _RawLogprobs(logits, None, *found)
        table = torch.log_softmax(logits, dim=-1, out=self._buffer("logprobs", rows, vocab, logits.device))
        values, ids = table.topk(top_n, dim=-1)  # (S, n) each
        return _RawLogprobs(logits, table, None, ids, values)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's argmax (S,) int64: the native kernel's where `native` and it takes these logits."""
        if self._takes_native(logits):
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

    def _draw(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        greedy: Sequence[bool],
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:
        """A token (S,) int64 for every row of `logits` from its temperature and filters, by one uniform `u` per
        row (greedy rows draw nothing from their generator; their entries are the caller's to replace).

        A row's tokens are ranked by its filters' rules; it takes the first token whose running sum of
        unnormalised probabilities exp(x - max) exceeds `u` times their total. On the CPU a filtered row's
        kept tokens are found among its best candidates (`_filter_candidates`) and summed in rank order; a row
        without filters, or whose kept set is not provably among its candidates, sums its whole row in token
        order after the full filters. Where `native` takes the logits, a row without filters is drawn by
        `native.draw_rows` instead (the same rule over its own exp and block-wise sums; torch's path for a row
        with a NaN). Each row's token depends on its own logits, parameters and `u` alone."""
        rows, vocab = logits.shape
        device = logits.device
        own = [(i, g) for i, g in enumerate(generators) if g is not None and not greedy[i]]
        draws = torch.empty(rows, device=device)  # (S,): seeded rows from their own generator, the rest shared
        if len(own) < rows:
            draws.uniform_()
        for i, g in own:
            draws[i : i + 1].uniform_(generator=g)
        sampled = torch.zeros(rows, dtype=torch.int64, device=device)
        filtered = [i for i, p in enumerate(params) if p.uses_filters and not greedy[i]]
        whole = [i for i, p in enumerate(params) if not p.uses_filters and not greedy[i]]
        if whole and self._takes_native(logits) and vocab <= native.DRAW_MAX_COLUMNS:
            plain = torch.tensor(whole, device=device)
            u = draws if len(whole) == rows else draws.index_select(0, plain)  # (R,)
            drawn = native.draw_rows(logits, whole, [params[i].temperature for i in whole], u)
            if drawn is not None:
                if len(whole) == rows:  # no gather or scatter (a batch of unfiltered rows: the common case)
                    return drawn
                sampled[plain], whole = drawn, []
        if not filtered and not whole:
            return sampled
        temperature = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], device=device)
        scaled = torch.div(logits, temperature[:, None], out=self._buffer("scaled", rows, vocab, device))  # (S, V)
        if filtered and device.type == "cpu":
            groups, rest = self._filter_candidates(scaled, params, filtered)
            for index, ids, kept in groups:  # (R,), (R, K) token ids, (R, K) kept values ranked, -inf dropped
                weights = (kept - kept[:, :1]).exp_()  # the first is each row's largest: it always stays
                cdf = weights.cumsum_(dim=-1)  # (R, K)
                pick = torch.searchsorted(cdf, draws[index][:, None] * cdf[:, -1:], right=True)  # (R, 1)
                sampled[index] = ids.gather(1, pick.clamp_max_(ids.shape[1] - 1)).squeeze(1)
            filtered = rest
        if filtered:  # the full filters (a stable sort of each row), then the whole row as below
            rest_rows = scaled[filtered]  # (R, V), contiguous
            native_sort = self._takes_native(rest_rows)
            scaled[filtered] = _filter_sorted_rows(rest_rows, [params[i] for i in filtered], native_sort)
            whole += filtered
        if whole:
            whole.sort()
            every = len(whole) == rows  # no gather or scatter (a batch of unfiltered rows: the common case)
            at = None if every else torch.tensor(whole, device=device)
            part = scaled if at is None else scaled.index_select(0, at)  # (R, V)
            weights = part.sub_(part.amax(dim=-1, keepdim=True)).exp_()  # (R, V): the row's own scale; dropped: 0
            cdf = torch.cumsum(weights, dim=-1, out=self._buffer("cdf", len(whole), vocab, device))  # (R, V)
            target = (draws if at is None else draws.index_select(0, at))[:, None] * cdf[:, -1:]  # (R, 1)
            tokens = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_max_(vocab - 1)  # (R,)
            if at is None:
                return tokens
            sampled[at] = tokens
        return sampled

    def _filter_candidates(
        self, scaled: torch.Tensor, params: Sequence[SamplingParams], rows: list[int]
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], list[int]]:
        """Top-k, then top-p, then min-p of the CPU rows `rows` of `scaled` (S, V), each on its best candidates
        (the largest of each size of `_CANDIDATES` in turn, `_ranked_candidates`, not a full sort): `(groups,
        rest)`, each group `(index (R,), ids (R, K), kept (R, K))`, the rows' candidate token ids and their
        values ranked as the full stable sort ranks them (descending, ties by token id), a dropped one -inf.
        A row is kept where provably exact (its last candidate is dropped and lies strictly below every kept
        token, so every token outside would be dropped too); `rest` are the rows no size settled (for the full
        sort)."""
        vocab = scaled.shape[1]
        groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        todo = list(rows)
        for size in _CANDIDATES:
            k = min(vocab, max([size] + [params[i].top_k for i in todo]))
            if not todo or k >= vocab:
                break
            index = torch.tensor(todo)
            part = scaled if todo == list(range(scaled.shape[0])) else scaled.index_select(0, index)  # (R, V)
            # only top-p without top-k measures mass against the whole vocabulary (its log-sum-exp)
            with_lse = any(params[i].top_p < 1 and params[i].top_k <= 0 for i in todo)
            values, ids, full_lse = self._ranked_candidates(part, k, with_lse)  # (R, K), (R, K), (R,) or None
            kept = _filter_sorted(values, [params[i] for i in todo], full_lse)  # (R, K)
            alive = kept > -math.inf
            min_kept = torch.where(alive, kept, math.inf).amin(dim=-1)  # (R,)
            exact = (~alive[:, -1] & (min_kept > values[:, -1])).tolist()  # (R,)
            done = torch.tensor([j for j, ok in enumerate(exact) if ok], dtype=torch.int64)
            if done.numel():
                groups.append((index[done], ids[done], kept[done]))
            todo = [i for i, ok in zip(todo, exact) if not ok]
        return groups, todo

    def _ranked_candidates(
        self, part: torch.Tensor, k: int, with_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`(values, ids, lse)`: the k largest of each row of `part` (R, V) and their token ids (R, k), ranked as
        the full stable sort ranks them (descending, equal values by token id), and, `with_lse`, each row's
        log-sum-exp (R,) (else None). From the native kernel's one pass (and its sum) where `native` takes them
        (k <= `native.TOP_LOGPROBS_MAX`, no NaN); else torch's `topk`, two sorts and `logsumexp`'s steps."""
        if self._takes_native(part) and k <= native.TOP_LOGPROBS_MAX:
            if with_lse:
                found = native.logprobs_rows(part, k)
                if found is not None:
                    shift, ids, _ = found
                    return part.gather(1, ids), ids, shift[:, 1] + shift[:, 0]  # log(sum exp(x - max)) + max
            else:
                top = native.top_rows(part, k)
                if top is not None:
                    return part.gather(1, top), top, None
        values, ids = part.topk(k, dim=-1)  # (R, K), descending
        ids, perm = ids.sort(dim=-1)  # ties broken by token id, as the full stable sort does
        values, order = values.gather(1, perm).sort(dim=-1, descending=True, stable=True)
        full_lse = None
        if with_lse:  # torch's logsumexp, step for step, through a kept buffer instead of a fresh (R, V) one
            top_value = part.amax(dim=-1, keepdim=True)  # (R, 1)
            work = torch.sub(part, top_value, out=self._buffer("lse", part.shape[0], part.shape[1], part.device))
            full_lse = work.exp_().sum(dim=-1).log_().add_(top_value.squeeze(1))  # (R,)
        return values, ids.gather(1, order), full_lse

    @staticmethod
    def _to_host(
        sampled: torch.Tensor, raw_logprobs: _RawLogprobs | None, params: Sequence[SamplingParams]
    ) -> SampleResult:
        rows = sampled.shape[0]
        if raw_logprobs is None:
            return SampleResult(sampled.tolist(), [None] * rows, [None] * rows)
        top_n = raw_logprobs.ids.shape[1]
        parts = [sampled[:, None].double(), raw_logprobs.picked(sampled).double()]
        if top_n:
            parts += [raw_logprobs.ids.double(), raw_logprobs.values.double()]
        # One transfer: ids travel as float64, exact for any vocabulary below 2**53.
        packed = torch.cat(parts, dim=1).tolist()  # (S, 2 + 2n)
        logprobs: list[float | None] = []
        top_logprobs: list[list[tuple[int, float]] | None] = []
        for p, row in zip(params, packed):
            logprobs.append(None if p.logprobs is None else row[1])
            top = None if p.logprobs is None else [(int(row[2 + j]), row[2 + top_n + j]) for j in range(p.logprobs)]
            top_logprobs.append(top)
        return SampleResult([int(row[0]) for row in packed], logprobs, top_logprobs)


@dataclass(frozen=True)
class _RawLogprobs:
    """The raw logits' log-probabilities a step reports: each row's top n (`ids`, `values`, (S, n), most likely
    first) and, by `picked`, its sampled token's. From torch's whole log-softmax (`table`), or from the native
    kernel's per-row maximum and log-sum (`shift`, (S, 2)) over the `raw` logits, which stay unchanged."""

    raw: torch.Tensor
    table: torch.Tensor | None
    shift: torch.Tensor | None
    ids: torch.Tensor
    values: torch.Tensor

    def picked(self, sampled: torch.Tensor) -> torch.Tensor:
        """(S, 1): the log-probability of each row's token `sampled` (S,), by the same formula as `values`."""
        if self.table is not None:
            return self.table.gather(1, sampled[:, None])
        assert self.shift is not None
        return (self.raw.gather(1, sampled[:, None]) - self.shift[:, :1]) - self.shift[:, 1:]


def _apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[TokenIds] | None,
    output_ids: Sequence[TokenIds] | None,
    scratch: torch.Tensor,
) -> None:
    """Each row's penalties applied to `logits` `[S, V]` float32 in place, touching only the tokens a row has
    seen: repetition over its prompt and output tokens (a positive logit divided by it, a negative one
    multiplied), then `x - frequency * count - presence` over its output tokens. A token's new value is computed
    by the same float32 operations, in the same order, as a dense pass over every token would compute it, and
    every other logit is left as it was. A token id outside `[0, V)` raises ValueError before anything changes.
    `scratch` (`[S, V]` float32, any contents, on the logits' device) holds the counts."""
    rows, vocab = logits.shape
    device = logits.device
    if output_ids is None or len(output_ids) != rows:
        raise ValueError("penalties need output_ids: one list of generated token ids per row")
    needs = [p.uses_penalties for p in params]
    repetition = [p.repetition_penalty for p in params]
    out_at, out_row = _positions([ids if n else () for ids, n in zip(output_ids, needs)], vocab)  # (N,) each
    rep_at = rep_row = None
    if any(r != 1 for r in repetition):
        if prompt_ids is None or len(prompt_ids) != rows:
            raise ValueError("repetition_penalty needs prompt_ids: one list of prompt token ids per row")
        prompt_at, prompt_row = _positions([ids if r != 1 else () for ids, r in zip(prompt_ids, repetition)], vocab)
        rep_at, rep_row = torch.cat((prompt_at, out_at)), torch.cat((prompt_row, out_row))
    flat = logits.view(-1)
    if rep_at is not None and rep_row is not None and rep_at.numel():
        # a token seen twice gets the same value twice: where it was written from does not matter
        at = rep_at.to(device, non_blocking=True)
        penalty = torch.tensor(repetition, device=device)[rep_row.to(device, non_blocking=True)]  # (N,)
        seen = flat[at]
        flat[at] = torch.where(seen > 0, seen / penalty, seen * penalty)
    if not out_at.numel():
        return
    at, row = out_at.to(device, non_blocking=True), out_row.to(device, non_blocking=True)
    counts = scratch.view(-1)
    counts[at] = 0  # only the positions read below: the rest of `scratch` is never looked at
    counts.index_put_((at,), torch.ones_like(at, dtype=torch.float32), accumulate=True)
    count = counts[at]  # (N,): how often each position's token occurs in its row's output
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[row]  # (N,)
    presence = torch.tensor([p.presence_penalty for p in params], device=device)[row]  # (N,)
    flat[at] = flat[at] - frequency * count - presence * (count > 0).float()


def _positions(rows: Sequence[TokenIds], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(at, row)`, int64 on the host: every token id of every row as its flat index `row * V + id` into a
    row-major `[S, V]`, and its row, in row order. A row may be a list of ints or an int64 array (taken as is:
    a long prompt's ids are converted once by their owner, not every step). Raises ValueError for an id outside
    `[0, V)`."""
    arrays = [np.asarray(r, dtype=np.int64) for r in rows]
    ids = torch.from_numpy(np.concatenate(arrays)) if arrays else torch.zeros(0, dtype=torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"penalty token ids must be in [0, {vocab_size}) (the logits' vocabulary)")
    lengths = torch.tensor([len(a) for a in arrays], dtype=torch.int64)
    row = torch.repeat_interleave(torch.arange(len(rows)), lengths)
    return row * vocab_size + ids, row


def _add_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Each row's `logit_bias` added to its tokens' logits in `logits` `[S, V]`, in place. A token id outside
    `[0, V)` raises ValueError (the request's own error) before anything changes."""
    vocab = logits.shape[1]
    rows, ids, values = [], [], []
    for i, p in enumerate(params):
        for token_id, bias in (p.logit_bias or {}).items():
            if token_id >= vocab:
                raise ValueError(f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab})")
            rows.append(i)
            ids.append(token_id)
            values.append(bias)
    if rows:
        index = (torch.tensor(rows, device=logits.device), torch.tensor(ids, device=logits.device))
        logits.index_put_(index, torch.tensor(values, device=logits.device), accumulate=True)


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


def _filter_sorted_rows(
    scaled: torch.Tensor, params: Sequence[SamplingParams], native_sort: bool = False
) -> torch.Tensor:
    """The filters over a full stable sort of each row (ties by token id); rows without filters come
    back unchanged (sorting and scattering back moves no value). `native_sort`: CPU rows sorted by
    `native.sort_rows` (the same values and order as torch's stable sort; torch's for a row with a NaN)."""
    found = native.sort_rows(scaled) if native_sort else None
    sorted_logits, order = found if found is not None else scaled.sort(dim=-1, descending=True, stable=True)
    return torch.empty_like(scaled).scatter_(1, order, _filter_sorted(sorted_logits, params, None))
