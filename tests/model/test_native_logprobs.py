"""`native.logprobs_rows`, a step's logprobs without a written (S, V) log-softmax: torch's `log_softmax` within
1e-6, its top tokens in torch's stable order, the same bits on every kernel path and whatever else is in the
batch, and the sampler's logprobs through it."""

from __future__ import annotations

import ctypes
import math

import pytest
import torch

from helexa.model.quant import isa, native
from helexa.model.sampling import Sampler, SamplingParams
from tests.support.kernel_paths import kernel_paths, require_native, use_kernel_path


def _rows(cols: int, g: torch.Generator) -> torch.Tensor:
    """Random rows (12, cols) and rows built to catch a wrong pick or sum: the maximum repeated (the lower
    columns first), ties straddling the k-th place, the maximum in the tail past the last 8 lanes, -inf
    entries beside finite ones, a row of one value, and a wide range."""
    x = torch.randn(12, cols, generator=g) * 3
    last = cols - 1
    picks = torch.randint(0, cols, (6,), generator=g).tolist()
    x[0, sorted(picks)] = 50.0
    x[1, last] = 60.0
    if cols > 3:  # a finite maximum stays (a row of only -inf has none: NaN, as in torch)
        x[2, picks[:3]] = -math.inf
    x[3] = 1.5
    x[4] = torch.randint(-3, 3, (cols,), generator=g).float()  # many equal values at every rank
    x[5] *= 20
    return x


def _expected_top(x: torch.Tensor, k: int) -> torch.Tensor:
    return x.sort(dim=-1, descending=True, stable=True).indices[:, :k]  # equal values: the lower column first


def _run(lib: ctypes.CDLL, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shift, ids, values = torch.full((x.shape[0], 2), math.nan), torch.full((x.shape[0], k), -7), torch.empty(0)
    values = torch.full((x.shape[0], k), math.nan)
    rc = lib.helexa_logprobs_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), k, shift.data_ptr(),
                                  ids.data_ptr(), values.data_ptr())  # fmt: skip
    assert rc == 0
    return shift, ids, values


@pytest.mark.parametrize("path", kernel_paths())
@pytest.mark.parametrize("cols", [1, 7, 8, 9, 64, 1001, 49155])
def test_logprobs_rows_are_torchs_log_softmax_and_top_tokens(
    path: str, cols: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_kernel_path(path, monkeypatch)
    g = torch.Generator().manual_seed(cols)
    x = _rows(cols, g)
    reference = torch.log_softmax(x.double(), dim=-1)
    for k in sorted({0, 1, min(5, cols), min(20, cols)}):
        found = native.logprobs_rows(x, k)
        assert found is not None
        shift, ids, values = found
        assert torch.equal(shift[:, 0], x.max(dim=-1).values)
        assert torch.equal(ids, _expected_top(x, k))
        assert torch.equal(native.top_rows(x, k), ids)  # the same pass without the sum
        assert torch.equal(values, (x.gather(1, ids) - shift[:, :1]) - shift[:, 1:])  # one formula for every token
        torch.testing.assert_close(values.double(), reference.gather(1, ids), rtol=1e-6, atol=2e-6)
        every = (x - shift[:, :1]) - shift[:, 1:]
        torch.testing.assert_close(every.double(), reference, rtol=1e-6, atol=2e-6)
        assert torch.equal(native.logprobs_rows(x[4:5], k)[2], values[4:5])  # alone: the same bits
        wide = torch.cat([x, torch.randn(12, 5, generator=g)], dim=1)[:, :cols]  # rows `cols + 5` floats apart
        assert all(torch.equal(a, b) for a, b in zip(native.logprobs_rows(wide, k), found))
        base, why = native.load_path(isa.PATHS["avx2"])
        assert base is not None, why
        assert all(torch.equal(a, b) for a, b in zip(_run(base, x, k), found))  # every path: the same bits


def test_logprobs_rows_leave_a_row_with_a_nan_to_torch_and_refuse_what_they_do_not_take() -> None:
    require_native()
    x = torch.randn(6, 300)
    x[3, 299] = math.nan
    assert native.logprobs_rows(x, 5) is None and native.top_rows(x, 5) is None
    x[3, 299] = 0.0
    x[2, 0] = math.nan  # among the first k values
    assert native.logprobs_rows(x, 5) is None
    for bad in (torch.zeros(2, 0), torch.zeros(4, 3).t(), torch.zeros(1, 3, dtype=torch.float64), torch.zeros(3)):
        with pytest.raises(ValueError, match="logprobs_rows takes"):
            native.logprobs_rows(bad, 1)
        with pytest.raises(ValueError, match="top_rows takes"):
            native.top_rows(bad, 1)
    for k in (-1, 4, native.TOP_LOGPROBS_MAX + 1):
        with pytest.raises(ValueError, match="0 <= k"):
            native.logprobs_rows(torch.zeros(2, 3 if k == 4 else 100), k)


def test_the_samplers_logprobs_through_the_native_kernel_match_torchs() -> None:
    require_native()
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 4099, generator=g) * 3
    params = [
        SamplingParams(temperature=0, logprobs=5),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, seed=2, logprobs=0),
        SamplingParams(temperature=0, logprobs=20, frequency_penalty=1.0),
        SamplingParams(temperature=0.7, top_p=0.9, seed=3, logprobs=2),
        SamplingParams(temperature=0, logprobs=1, logit_bias={7: 100.0}),
    ]

    def run(native_rows: bool, x: torch.Tensor):
        gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
        return Sampler(native=native_rows).sample(x, params, gens, prompt_ids=[[]] * 6, output_ids=[[1, 2]] * 6)

    for x in (logits, torch.where(torch.arange(4099) == 9, math.nan, logits)):  # a NaN row: torch's path
        fast, plain = run(True, x), run(False, x)
        if x is logits:
            assert fast.token_ids[5] == 7 and fast.logprobs[5] < -5  # raw: the bias that picked 7 is not in it
        assert fast.token_ids == plain.token_ids
        for r, p in enumerate(params):
            if p.logprobs is None:
                assert fast.logprobs[r] is None and fast.top_logprobs[r] is None
                continue
            assert fast.logprobs[r] == pytest.approx(plain.logprobs[r], abs=2e-6, rel=1e-6, nan_ok=True)
            assert [t for t, _ in fast.top_logprobs[r]] == [t for t, _ in plain.top_logprobs[r]]
            assert [v for _, v in fast.top_logprobs[r]] == pytest.approx(
                [v for _, v in plain.top_logprobs[r]], abs=2e-6, rel=1e-6, nan_ok=True
            )
            chosen = dict(fast.top_logprobs[r]).get(fast.token_ids[r])
            assert chosen is None or chosen == fast.logprobs[r] or x is not logits  # one formula: the same bits
