"""`native.draw_rows`, a sampled row without filters drawn without torch's (S, V) temporaries: the token of
the running-sum rule (checked against a float64 reference wherever the draw is not within float32 rounding
of a boundary), never a token of weight 0, frequencies that follow the distribution, the same token alone
and in any batch and on every kernel path, and the sampler's unfiltered rows through it."""

from __future__ import annotations

import ctypes
import math

import pytest
import torch

from helexa.model.quant import isa, native
from helexa.model.sampling import Sampler, SamplingParams, make_generator
from tests.support.kernel_paths import kernel_paths, require_native, use_kernel_path

_TEMPERATURES = [1.0, 0.3, 1.7, 0.05]


def _rows(cols: int, g: torch.Generator) -> torch.Tensor:
    """Random rows (8, cols): plain, peaked, flat, with -inf columns (masked), and a wide range."""
    x = torch.randn(8, cols, generator=g) * 3
    x[1] *= 8
    x[2] *= 0.01
    if cols > 4:
        x[3, torch.randperm(cols, generator=g)[: cols // 2]] = -math.inf
        x[4, : cols - 2] = -math.inf  # only the last two columns can be drawn
    x[5] += 1000.0
    return x


def _reference(x: torch.Tensor, rows: list[int], temps: list[float], u: torch.Tensor) -> tuple[list[int], list[bool]]:
    """The rule in float64: (token, whether u * total lies farther than 1e-5 of the total from every boundary
    of the running sum, where float32 rounding cannot move the answer)."""
    tokens, clear = [], []
    for r, t, v in zip(rows, temps, u.tolist()):
        y = x[r].double() / t
        w = (y - y.max()).exp()
        cdf = w.cumsum(0)
        target = v * float(cdf[-1])
        tokens.append(int(torch.searchsorted(cdf, torch.tensor([target], dtype=torch.float64), right=True)))
        clear.append(bool((cdf - target).abs().min() > 1e-5 * float(cdf[-1])))
    return tokens, clear


def _run(lib: ctypes.CDLL, x: torch.Tensor, rows: list[int], temps: list[float], u: torch.Tensor) -> list[int]:
    out = torch.full((len(rows),), -7, dtype=torch.int64)
    which, t = torch.tensor(rows), torch.tensor(temps, dtype=torch.float32)
    rc = lib.helexa_draw_rows(x.data_ptr(), x.shape[1], x.stride(0), which.data_ptr(), len(rows), t.data_ptr(),
                              u.data_ptr(), out.data_ptr())  # fmt: skip
    assert rc == 0
    return out.tolist()


@pytest.mark.parametrize("path", kernel_paths())
@pytest.mark.parametrize("cols", [1, 7, 8, 9, 64, 65, 1001, 49155])
def test_draw_rows_follow_the_running_sum_rule(path: str, cols: int, monkeypatch: pytest.MonkeyPatch) -> None:
    use_kernel_path(path, monkeypatch)
    g = torch.Generator().manual_seed(cols)
    x = _rows(cols, g)
    base, why = native.load_path(isa.PATHS["avx2"])
    assert base is not None, why
    checked = 0
    for _ in range(6):
        rows = torch.randint(0, 8, (12,), generator=g).tolist()
        temps = [_TEMPERATURES[i % 4] for i in range(12)]
        u = torch.rand(12, generator=g)
        got = native.draw_rows(x, rows, temps, u)
        assert got is not None
        expected, clear = _reference(x, rows, temps, u)
        for token, want, ok, r in zip(got.tolist(), expected, clear, rows):
            assert x[r, token] > -math.inf  # never a column of weight 0
            if ok:
                assert token == want
                checked += 1
        assert [
            int(native.draw_rows(x, [r], [t], u[i : i + 1])[0]) for i, (r, t) in enumerate(zip(rows, temps))
        ] == got.tolist()
        wide = torch.cat([x, torch.randn(8, 5, generator=g)], dim=1)[:, :cols]  # rows `cols + 5` floats apart
        assert torch.equal(native.draw_rows(wide, rows, temps, u), got)
        assert _run(base, x, rows, temps, u) == got.tolist()  # every path: the same tokens
    assert checked >= 60  # nearly every draw lies clear of a boundary


def test_draw_rows_frequencies_follow_the_distribution() -> None:
    require_native()
    probs = torch.tensor([0.4, 0.3, 0.2, 0.07, 0.03])
    vocab, n = 1000, 20000
    row = torch.full((vocab,), -math.inf)
    ids = torch.tensor([3, 200, 201, 640, 999])  # across blocks of 64 and in the last one
    row[ids] = probs.log() + 2.0
    x = row.expand(n, vocab).contiguous()
    u = torch.rand(n, generator=torch.Generator().manual_seed(1))
    tokens = native.draw_rows(x, list(range(n)), [1.0] * n, u)
    assert tokens is not None
    counts = torch.bincount(tokens, minlength=vocab)
    assert counts.sum() == counts[ids].sum() == n
    expected = probs * n
    chi2 = float(((counts[ids].double() - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # 4 degrees of freedom: p < 0.0005
    assert native.draw_rows(x[:1], [0], [1.0], torch.zeros(1)).item() == 3  # u = 0: the first column of weight


def test_draw_rows_leave_bad_rows_to_torch_and_refuse_what_they_do_not_take() -> None:
    require_native()
    x = torch.randn(3, 100)
    u = torch.rand(2)
    x[1, 50] = math.nan
    assert native.draw_rows(x, [0, 1], [1.0, 1.0], u) is None
    x[1, 50] = math.inf  # no finite maximum
    assert native.draw_rows(x, [0, 1], [1.0, 1.0], u) is None
    assert native.draw_rows(x, [0, 2], [1.0, 1.0], u) is not None
    for bad in (torch.zeros(2, 0), torch.zeros(4, 3).t(), torch.zeros(1, 3, dtype=torch.float64), torch.zeros(3)):
        with pytest.raises(ValueError, match="draw_rows takes"):
            native.draw_rows(bad, [0], [1.0], torch.zeros(1))
    with pytest.raises(ValueError, match="one temperature"):
        native.draw_rows(x, [0, 2], [1.0], u)
    with pytest.raises(ValueError, match="rows of x"):
        native.draw_rows(x, [0, 3], [1.0, 1.0], u)
    with pytest.raises(ValueError, match="temperatures > 0"):
        native.draw_rows(x, [0, 2], [1.0, 0.0], u)


def test_the_samplers_unfiltered_rows_take_the_native_draw() -> None:
    require_native()
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 4099, generator=g) * 3
    params = [
        SamplingParams(temperature=0.9, seed=1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, seed=2),
        SamplingParams(temperature=0.7, top_p=0.9, seed=3),  # filtered: its candidates, as before
    ]
    for _ in range(5):
        gens = [None if p.seed is None else make_generator(p.seed, "cpu") for p in params]
        u = [torch.empty(1).uniform_(generator=make_generator(p.seed, "cpu")) if p.seed else None for p in params]
        out = Sampler(native=True).sample(logits, params, gens).token_ids
        assert out[0] == int(native.draw_rows(logits, [0], [0.9], u[0])[0])
        assert out[2] == int(native.draw_rows(logits, [2], [1.3], u[2])[0])
        assert out[1] == int(logits[1].argmax())
        plain = Sampler().sample(
            logits, params, [None if p.seed is None else make_generator(p.seed, "cpu") for p in params]
        )
        assert out[3] == plain.token_ids[3]
        logits = logits.roll(1, dims=1)
