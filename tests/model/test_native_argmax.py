"""`native.argmax_rows`, a greedy step's tokens from its logits: torch's argmax indices on every kernel path
(the first of equal maxima, the first NaN where a row has one), and the sampler's greedy rows through it."""

from __future__ import annotations

import math

import pytest
import torch

from helexa.model.quant import native
from helexa.model.sampling import Sampler, SamplingParams
from tests.support.kernel_paths import kernel_paths, require_native, use_kernel_path


def _hard_rows(cols: int, g: torch.Generator) -> torch.Tensor:
    """Random rows (16, cols) and rows built to catch a wrong pick: the maximum repeated (later copies
    must lose), in the tail past the last 8 lanes, NaN (the first one wins, after and before a larger
    value), +inf, all -inf, -0.0 against +0.0, and a maximum that is negative."""
    x = torch.randn(16, cols, generator=g) * 3
    last = cols - 1
    picks = torch.randint(0, cols, (6,), generator=g).tolist()
    x[0, sorted(picks)] = 50.0  # ties: the smallest index
    x[1, last] = 60.0  # the tail after the vector lanes (when cols % 8)
    x[2, picks[0]], x[2, (picks[0] + 3) % cols], x[2, 0] = math.nan, math.nan, 70.0
    x[3, last], x[3, 0] = math.nan, 80.0
    x[4, picks[1]] = math.inf
    x[5] = -math.inf
    x[6] = 0.0
    x[6, picks[2]] = -0.0
    x[7] = -torch.rand(cols, generator=g) - 1
    return x


@pytest.mark.parametrize("path", kernel_paths())
@pytest.mark.parametrize("cols", [1, 7, 8, 9, 64, 1001, 49155])
def test_argmax_rows_gives_torchs_indices(path: str, cols: int, monkeypatch: pytest.MonkeyPatch) -> None:
    use_kernel_path(path, monkeypatch)
    g = torch.Generator().manual_seed(cols)
    x = _hard_rows(cols, g)
    assert torch.equal(native.argmax_rows(x), x.argmax(dim=-1))
    wide = _hard_rows(cols + 5, g)  # a slice of columns: rows `cols + 5` floats apart
    assert torch.equal(native.argmax_rows(wide[:, :cols]), wide[:, :cols].argmax(dim=-1))
    assert torch.equal(native.argmax_rows(x[5:6]), x[5:6].argmax(dim=-1))  # one row (not in parallel)


def test_argmax_rows_refuses_what_it_does_not_take() -> None:
    require_native()
    for bad in (torch.zeros(2, 0), torch.zeros(4, 3).t(), torch.zeros(3, dtype=torch.float64).view(1, 3),
                torch.zeros(3)):  # fmt: skip
        with pytest.raises(ValueError, match="argmax_rows takes"):
            native.argmax_rows(bad)


def test_the_samplers_greedy_rows_take_the_native_argmax_and_torchs_tokens() -> None:
    require_native()
    g = torch.Generator().manual_seed(3)
    logits = _hard_rows(4099, g)[:8]
    params = [SamplingParams(temperature=0.0)] * 8
    calls = []
    real = native.argmax_rows

    def counting(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape)
        return real(x)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "argmax_rows", counting)
        fast = Sampler(native=True).sample(logits, params).token_ids
        plain = Sampler().sample(logits, params).token_ids
    assert calls == [logits.shape] and fast == plain == logits.argmax(dim=-1).tolist()
    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1)] * 4
    gens = [None if p.is_greedy else torch.Generator().manual_seed(i) for i, p in enumerate(mixed)]
    greedy_rows = Sampler(native=True).sample(logits, mixed, gens).token_ids[0::2]
    assert greedy_rows == logits.argmax(dim=-1).tolist()[0::2]
