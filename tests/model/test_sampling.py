"""Sampler: seeded reproducibility, exact filter masks, penalties by hand, logprobs, validation."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from helexa.model.quant import native
from helexa.model.sampling import Sampler, SamplingParams, make_generator
from helexa.model.sampling.sampler import _apply_penalties

V = 64


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * 3  # (S, V), distinct values


def _sample_many(logits_row: torch.Tensor, params: SamplingParams, n: int) -> set[int]:
    """Tokens drawn from one row over n draws (rows replicated in a batch)."""
    out = Sampler().sample(logits_row.expand(n, V).contiguous(), [params] * n)
    return set(out.token_ids)


# ---------------------------------------------------------------------------- params validation


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.1}, "min_p"),
        ({"seed": 1.5}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"stop": [""]}, "stop"),
        ({"stop": 3}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"logprobs": 21}, "logprobs"),
        ({"n": 0}, "n"),
    ],
)
def test_params_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_params_normalisation() -> None:
    p = SamplingParams(stop="###", stop_token_ids=[3, 4])
    assert p.stop == ("###",) and p.stop_token_ids == (3, 4) and p.max_tokens == 16
    assert SamplingParams(stop=None, stop_token_ids=None).stop == ()
    assert SamplingParams(temperature=0).is_greedy and not SamplingParams().is_greedy
    assert SamplingParams(top_k=0).uses_filters is False and SamplingParams(min_p=0.1).uses_filters
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.5  # type: ignore[misc]  # frozen


# ---------------------------------------------------------------------------- greedy and seeds


def test_greedy_is_argmax_with_mixed_batch() -> None:
    logits = _logits(6)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0)] * 3
    out = Sampler().sample(logits, params)
    expected = logits.argmax(-1).tolist()
    assert [out.token_ids[i] for i in (0, 2, 4)] == [expected[i] for i in (0, 2, 4)]
    assert out.logprobs == [None] * 6


def test_seeded_rows_reproduce_across_batch_compositions() -> None:
    sampler = Sampler()
    target = _logits(1, seed=3)  # (1, V)
    p = SamplingParams(temperature=1.3, top_p=0.95, top_k=40, seed=1234)

    def run(batch: list[tuple[torch.Tensor, SamplingParams, torch.Generator | None]], steps: int) -> list[list[int]]:
        rows = torch.cat([b[0] for b in batch])
        gens = [b[2] for b in batch]
        return [sampler.sample(rows, [b[1] for b in batch], gens).token_ids for _ in range(steps)]

    alone = run([(target, p, make_generator(1234, "cpu"))], 20)
    others = [(_logits(1, seed=s), SamplingParams(temperature=0.8, seed=s), make_generator(s, "cpu")) for s in (7, 8)]
    crowd = run(
        [others[0], (target, p, make_generator(1234, "cpu")), others[1], (_logits(1, 9), SamplingParams(), None)], 20
    )
    assert [step[0] for step in alone] == [step[1] for step in crowd]
    assert len({step[0] for step in alone}) > 1  # really random: several tokens over 20 steps
    different = run([(target, p, make_generator(99, "cpu"))], 20)
    assert [step[0] for step in different] != [step[0] for step in alone]


def test_seed_without_generator_is_rejected() -> None:
    with pytest.raises(ValueError, match="generator"):
        Sampler().sample(_logits(1), [SamplingParams(seed=1)])
    with pytest.raises(ValueError, match="rows"):
        Sampler().sample(_logits(2), [SamplingParams()])
    with pytest.raises(ValueError, match="float32"):
        Sampler().sample(_logits(1).double(), [SamplingParams()])


def test_sampling_frequencies_follow_the_distribution() -> None:
    logits = torch.tensor([[math.log(0.6), math.log(0.3), math.log(0.1)]])  # (1, 3)
    n = 4000
    torch.manual_seed(0)
    out = Sampler().sample(logits.expand(n, 3).contiguous(), [SamplingParams()] * n)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=3).float() / n
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.03)


# ---------------------------------------------------------------------------- filters


def test_top_k_mask_exact() -> None:
    row = _logits(1, seed=11)
    allowed = set(row[0].topk(5).indices.tolist())
    assert _sample_many(row, SamplingParams(top_k=5, temperature=5.0), 3000) == allowed


def test_top_p_mask_exact() -> None:
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02])
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(1))
    row = torch.log(probs[perm])[None, :]  # (1, 7), shuffled so the order is not the id order
    # Probability mass ranked above each token: 0, .4, .65, .8, .9, .95, .98; a token survives while
    # that mass is below top_p, so top_p=0.79 keeps 3 tokens and 0.85 keeps 4.
    for top_p, keep in ((0.5, 2), (0.79, 3), (0.85, 4), (0.97, 6)):
        expected = {int(perm.tolist().index(j)) for j in range(keep)}
        got = set(Sampler().sample(row.expand(2000, 7).contiguous(), [SamplingParams(top_p=top_p)] * 2000).token_ids)
        assert got == expected, top_p


def test_top_k_then_top_p_renormalises() -> None:
    row = torch.log(torch.tensor([[0.3, 0.3, 0.2, 0.2]]))
    # After top_k=2 the two survivors have 0.5 each: top_p=0.5 keeps only the first of them.
    got = set(Sampler().sample(row.expand(500, 4).contiguous(), [SamplingParams(top_k=2, top_p=0.5)] * 500).token_ids)
    assert got == {0}


def test_min_p_mask_exact() -> None:
    row = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    # min_p=0.25: threshold 0.125 keeps {0, 1, 2}.
    got = set(Sampler().sample(row.expand(2000, 5).contiguous(), [SamplingParams(min_p=0.25)] * 2000).token_ids)
    assert got == {0, 1, 2}


def test_filters_apply_per_row() -> None:
    logits = _logits(3, seed=21)
    params = [SamplingParams(top_k=1, temperature=2.0), SamplingParams(temperature=2.0), SamplingParams(top_k=2)]
    rows = [0, 1, 2] * 400
    out = Sampler().sample(logits[rows], [params[r] for r in rows])
    by_row = {r: {t for t, rr in zip(out.token_ids, rows) if rr == r} for r in range(3)}
    assert by_row[0] == {int(logits[0].argmax())}
    assert len(by_row[1]) > 5
    assert by_row[2] == set(logits[2].topk(2).indices.tolist())


# ---------------------------------------------------------------------------- penalties


def test_penalties_match_hand_computation() -> None:
    logits = _logits(2, seed=5)
    top = logits.argmax(-1).tolist()
    prompt = [[1, 2, 2, 3], [4]]
    output = [[top[0], top[0], 5, 1, 3], [top[1], 4, 6]]  # the raw argmax is penalised in both rows
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.7, frequency_penalty=0.4, presence_penalty=0.9),
        SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=-0.5),
    ]
    expected = logits.clone()
    for r, p in enumerate(params):
        if p.repetition_penalty != 1:
            for t in set(prompt[r]) | set(output[r]):  # repetition: prompt and output tokens
                x = float(expected[r, t])
                expected[r, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for t in set(output[r]):  # frequency and presence: output tokens only
            expected[r, t] -= p.frequency_penalty * output[r].count(t) + p.presence_penalty
    got = logits.clone()
    _apply_penalties(got, params, prompt, output, torch.empty_like(logits))
    torch.testing.assert_close(got, expected)
    out = Sampler().sample(logits, params, prompt_ids=prompt, output_ids=output)
    assert out.token_ids == expected.argmax(-1).tolist()
    assert out.token_ids != top


def _dense_penalties(logits, params, prompt, output):  # every token of every row: the reference
    rows, vocab = logits.shape

    def counts(ids_by_row):
        out = torch.zeros(rows, vocab)
        for r, ids in enumerate(ids_by_row):
            for t in ids:
                out[r, t] += 1
        return out

    out_counts = counts([ids if p.uses_penalties else () for ids, p in zip(output, params)])
    seen = (counts([ids if p.repetition_penalty != 1 else () for ids, p in zip(prompt, params)]) > 0) | (out_counts > 0)
    penalty = torch.tensor([p.repetition_penalty for p in params])[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    frequency = torch.tensor([p.frequency_penalty for p in params])[:, None]
    presence = torch.tensor([p.presence_penalty for p in params])[:, None]
    return logits - frequency * out_counts - presence * (out_counts > 0).float()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_penalties_touch_only_seen_tokens_and_equal_a_dense_pass_bit_for_bit(seed: int) -> None:
    """Random rows, prompts and outputs (repeats, tokens in both, rows without penalties, negative penalties):
    the in-place pass over the seen tokens gives every logit the bits a pass over the whole vocabulary gives,
    through a sampler whose kept buffers hold another call's leftovers; the caller's logits stay unchanged."""
    g = torch.Generator().manual_seed(seed)
    rows = 6
    logits = torch.randn(rows, V, generator=g) * 4
    raw = logits.clone()

    def ids(n: int) -> list[int]:
        return torch.randint(0, V, (n,), generator=g).tolist()

    prompt = [ids(int(torch.randint(0, 40, (1,), generator=g))) for _ in range(rows)]
    output = [ids(int(torch.randint(0, 30, (1,), generator=g))) for _ in range(rows)]
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=-0.4),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, frequency_penalty=-1.5),
        SamplingParams(temperature=0, repetition_penalty=0.8),
        SamplingParams(temperature=0, presence_penalty=2.0, logit_bias={3: 5.0}),
        SamplingParams(temperature=0, repetition_penalty=1.1, presence_penalty=0.25),
    ]
    expected = _dense_penalties(logits, params, prompt, output)
    got = logits.clone()
    _apply_penalties(got, params, prompt, output, torch.randn(rows, V, generator=g))
    assert torch.equal(got, expected)
    sampler = Sampler()
    sampler.sample(
        torch.randn(rows, V, generator=g),
        [SamplingParams(temperature=0, presence_penalty=2.0)] * rows,
        output_ids=[list(range(V))] * rows,
    )  # fills the kept buffers with another call's values
    biased = expected.clone()
    biased[4, 3] += 5.0
    out = sampler.sample(logits, params, prompt_ids=prompt, output_ids=output)
    assert out.token_ids == biased.argmax(-1).tolist()
    assert torch.equal(logits, raw)


def test_penalties_need_ids() -> None:
    with pytest.raises(ValueError, match="output_ids"):
        Sampler().sample(_logits(1), [SamplingParams(presence_penalty=1.0)])
    with pytest.raises(ValueError, match="prompt_ids"):
        Sampler().sample(_logits(1), [SamplingParams(repetition_penalty=1.2)], output_ids=[[1]])
    with pytest.raises(ValueError, match="penalty token ids"):
        Sampler().sample(_logits(1), [SamplingParams(presence_penalty=1.0)], output_ids=[[V + 3]])
    with pytest.raises(ValueError, match="penalty token ids"):  # the vocabulary's size itself is outside
        Sampler().sample(_logits(1), [SamplingParams(presence_penalty=1.0)], output_ids=[[V]])
    with pytest.raises(ValueError, match="penalty token ids"):
        Sampler().sample(_logits(1), [SamplingParams(repetition_penalty=1.2)], prompt_ids=[[-1]], output_ids=[[1]])


# ---------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_model_logprobs() -> None:
    logits = _logits(3, seed=8)
    params = [
        SamplingParams(temperature=0.5, top_k=3, logprobs=4, frequency_penalty=1.0),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logprobs=0),
    ]
    out = Sampler().sample(logits, params, output_ids=[[1, 2], [], []])
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[1] is None and out.top_logprobs[1] is None
    assert out.top_logprobs[2] == []
    for r in (0, 2):
        assert out.logprobs[r] == pytest.approx(float(raw[r, out.token_ids[r]]), abs=1e-6)
    values, ids = raw[0].topk(4)
    assert [t for t, _ in out.top_logprobs[0]] == ids.tolist()
    assert [v for _, v in out.top_logprobs[0]] == pytest.approx(values.tolist(), abs=1e-6)
    assert out.token_ids[2] == int(logits[2].argmax())


@pytest.mark.parametrize("native_rows", [False, True])
def test_filtered_rows_draw_from_their_candidates_with_the_right_frequencies(native_rows: bool) -> None:
    """Over a large vocabulary a top-p row's kept tokens are found among its best candidates and drawn in rank
    order: their frequencies follow the renormalised probabilities, and nothing outside them is drawn."""
    if native_rows and not native.available():
        pytest.skip(f"helexa's CPU kernel is unavailable: {native.unavailable_reason()}")
    vocab, n = 5000, 6000
    probs = torch.tensor([0.35, 0.25, 0.15, 0.1, 0.08, 0.04, 0.02, 0.01])  # 0.98 of the mass; top_p 0.9 keeps 5
    row = torch.full((vocab,), math.log(0.02 / (vocab - 8)))
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(2))[:8]
    row[ids] = probs.log()
    torch.manual_seed(0)
    sampler = Sampler(native=native_rows)
    out = sampler.sample(row.expand(n, vocab).contiguous(), [SamplingParams(temperature=1.0, top_p=0.9)] * n)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=vocab).float() / n
    assert set(torch.nonzero(counts).flatten().tolist()) == set(ids[:5].tolist())
    assert torch.allclose(counts[ids[:5]], probs[:5] / probs[:5].sum(), atol=0.03)


@pytest.mark.parametrize("native_rows", [False, True])
def test_each_row_draws_alone_whichever_path_its_batch_takes(native_rows: bool) -> None:
    """A batch mixing rows drawn from their candidates, rows without filters (their whole row; through the
    native kernel with `native_rows`) and a filtered row no candidate set settles (a flat top-p: the full
    sort), with greedy rows between: each seeded row's token is the one it draws alone."""
    if native_rows and not native.available():
        pytest.skip(f"helexa's CPU kernel is unavailable: {native.unavailable_reason()}")
    g = torch.Generator().manual_seed(5)
    vocab = 3000
    logits = torch.randn(5, vocab, generator=g) * torch.tensor([[4.0], [0.01], [4.0], [3.0], [4.0]])
    params = [
        SamplingParams(temperature=0.9, seed=1),  # whole row
        SamplingParams(temperature=1.0, top_p=0.999, seed=2),  # flat: the full sort
        SamplingParams(temperature=0.0),  # greedy
        SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=3),  # candidates
        SamplingParams(temperature=1.2, seed=4),  # whole row
    ]

    def gens() -> list[torch.Generator | None]:
        return [None if p.seed is None else make_generator(p.seed, "cpu") for p in params]

    batch_gens, alone_gens = gens(), gens()
    for _ in range(10):
        sampler = Sampler(native=native_rows)
        together = sampler.sample(logits, params, batch_gens).token_ids
        alone = [sampler.sample(logits[i : i + 1], [p], [alone_gens[i]]).token_ids[0] for i, p in enumerate(params)]
        assert together == alone


@pytest.mark.parametrize("native_rows", [False, True])
@pytest.mark.parametrize("quantised", [False, True])
def test_candidate_filter_path_equals_full_sort(quantised: bool, native_rows: bool) -> None:
    """The candidates' fast path (torch's topk, or with `native_rows` the native kernel's ranked top tokens)
    keeps exactly the tokens the full stable sort keeps, ties and fallbacks included."""
    from helexa.model.sampling.sampler import _filter_sorted_rows

    if native_rows and not native.available():
        pytest.skip(f"helexa's CPU kernel is unavailable: {native.unavailable_reason()}")

    gen = torch.Generator().manual_seed(11)
    vocab = 6000
    scales = torch.tensor([0.3, 1.0, 3.0, 8.0, 1.0, 0.05, 2.0, 1.0, 5.0, 0.5])[:, None]
    logits = torch.randn(10, vocab, generator=gen) * scales
    if quantised:  # many exact ties, also at the filter boundaries
        logits = (logits * 4).round() / 4
    params = [
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=50),
        SamplingParams(temperature=1.0, top_k=2000, top_p=0.95),
        SamplingParams(temperature=1.0, min_p=0.05),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_p=0.999),  # flat: falls back
        SamplingParams(temperature=1.0, top_k=5, min_p=0.2),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=1.0, top_p=0.8, min_p=0.01),
        SamplingParams(temperature=1.0, min_p=0.5),
    ]
    groups, rest = Sampler(native=native_rows)._filter_candidates(logits, params, list(range(len(params))))
    fast = torch.full_like(logits, -math.inf)
    for index, ids, kept in groups:
        fast[index] = fast[index].scatter_(1, ids, kept)
    if rest:
        fast[rest] = _filter_sorted_rows(logits[rest], [params[i] for i in rest], native_sort=native_rows)
    assert sum(len(index) for index, _, _ in groups) >= 5  # most rows settle on candidates
    full = _filter_sorted_rows(logits, params)
    if native_rows:  # the native sort gives the full sort's filters bit for bit
        assert torch.equal(_filter_sorted_rows(logits, params, native_sort=True), full)
    full[[i for i, p in enumerate(params) if not p.uses_filters]] = -math.inf  # the candidates are filtered rows'
    fast[[i for i, p in enumerate(params) if not p.uses_filters]] = -math.inf
    assert torch.equal(fast.isfinite(), full.isfinite())
    assert torch.equal(fast[fast.isfinite()], full[full.isfinite()])


# ---------------------------------------------------------------------------- grammar masks and logit_bias


def _allow(rows: int, allowed: dict[int, list[int]]) -> torch.Tensor:
    """A bitmask of `rows` rows: every token allowed, except in the rows of `allowed` (only those ids)."""
    from helexa.model.sampling.bitmask import allocate_bitmask

    mask = allocate_bitmask(rows, V)
    for row, ids in allowed.items():
        mask[row] = 0
        for t in ids:
            mask[row, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    return mask


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_come_from_the_distribution_before_the_grammar_mask(temperature: float) -> None:
    logits = _logits(3)
    before = logits.clone()
    params = [SamplingParams(temperature=temperature, logprobs=5, seed=1)] * 3
    gens = [make_generator(1, "cpu") for _ in range(3)]
    out = Sampler().sample(logits, params, gens, bitmask=_allow(3, {0: [7], 2: [3, 9]}))
    raw = torch.log_softmax(before, dim=-1)
    assert torch.equal(logits, before)  # the caller's logits are not changed
    assert out.token_ids[0] == 7 and out.token_ids[2] in (3, 9)  # the mask decides what is sampled
    for row in range(3):
        token = out.token_ids[row]
        assert out.logprobs[row] == pytest.approx(raw[row, token].item(), abs=1e-5)  # not 0.0 for a forced token
        top = out.top_logprobs[row]
        assert [t for t, _ in top] == raw[row].topk(5).indices.tolist()  # masked tokens stay alternatives
        assert all(math.isfinite(v) for _, v in top)


def test_logit_bias_bans_and_forces_tokens_and_leaves_logprobs_raw() -> None:
    logits = _logits(2)
    banned = int(logits[0].argmax())
    params = [SamplingParams(temperature=0, logprobs=0, logit_bias={banned: -100}), SamplingParams(
        temperature=0, logprobs=0, logit_bias={5: 100.0})]  # fmt: skip
    out = Sampler().sample(logits, params)
    assert out.token_ids[0] != banned and out.token_ids[1] == 5
    assert out.logprobs[1] == pytest.approx(torch.log_softmax(logits[1], -1)[5].item(), abs=1e-5)
    with pytest.raises(ValueError, match="logit_bias token id 64"):
        Sampler().sample(_logits(1), [SamplingParams(logit_bias={V: 1.0})])


@pytest.mark.parametrize("bias", [{1: 101}, {-1: 1}, {1: math.inf}, {1: math.nan}, {1: 10**400}, {1: True}, [1]])
def test_bad_logit_bias_is_refused(bias: object) -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)  # type: ignore[arg-type]


@pytest.mark.parametrize("vocab", [1, 31, 33, 200])
@pytest.mark.parametrize("into", [False, True], ids=["new", "out"])
def test_masked_logits_sets_exactly_the_forbidden_tokens(vocab: int, into: bool) -> None:
    """Bit j of word w forbids token 32 w + j where clear; rows with every bit set are copied unchanged, the
    words past the vocabulary are ignored, the input is left alone; into `out` when given."""
    from helexa.model.sampling.bitmask import allocate_bitmask, masked_logits

    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g)
    before = logits.clone()
    bitmask = allocate_bitmask(5, vocab + 40)  # wider than the vocabulary: the extra words are ignored
    for row in (0, 2, 3):
        bitmask[row] = torch.randint(-(2**31), 2**31, (bitmask.shape[1],), generator=g, dtype=torch.int64).int()
    out = torch.full((5, vocab), float("nan")) if into else None
    got = masked_logits(logits, bitmask, out)
    want = logits.clone()
    for row in range(5):
        for token in range(vocab):
            if not (int(bitmask[row, token // 32]) >> (token % 32)) & 1:
                want[row, token] = -math.inf
    assert torch.equal(got, want) and torch.equal(logits, before)
    assert (got is out) if into else (got is not logits)
