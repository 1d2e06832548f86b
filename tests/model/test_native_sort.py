"""`native.sort_rows`, the full sort a flat top-p row falls back to: torch's stable descending sort, the same
values bit for bit and the same order (equal values, -0.0 against +0.0 among them, by column), on every
kernel path."""

from __future__ import annotations

import math

import pytest
import torch

from helexa.model.quant import native
from tests.support.kernel_paths import kernel_paths, require_native, use_kernel_path


def _rows(cols: int, g: torch.Generator) -> torch.Tensor:
    """Random rows (8, cols) and rows built to catch a wrong order: many exact ties, zeros of both signs mixed,
    infinities, a constant row, and a wide range of magnitudes."""
    x = torch.randn(8, cols, generator=g) * 3
    x[1] = (x[1] * 2).round() / 2
    x[2] = torch.where(torch.rand(cols, generator=g) < 0.5, 0.0, -0.0)
    x[2, :: max(1, cols // 5)] = 1.0
    x[3, ::3] = -math.inf
    x[3, 1::5] = math.inf
    x[4] = 7.0
    x[5] = torch.randn(cols, generator=g) * torch.logspace(-30, 30, cols)
    x[6] = -x[6].abs()
    return x


@pytest.mark.parametrize("path", kernel_paths())
@pytest.mark.parametrize("cols", [1, 7, 8, 9, 2047, 2049, 49155])
def test_sort_rows_are_torchs_stable_descending_sort(path: str, cols: int, monkeypatch: pytest.MonkeyPatch) -> None:
    use_kernel_path(path, monkeypatch)
    g = torch.Generator().manual_seed(cols)
    x = _rows(cols, g)
    found = native.sort_rows(x)
    assert found is not None
    values, ids = found
    expected_values, expected_ids = x.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(ids, expected_ids)
    assert torch.equal(values.view(torch.int32), expected_values.view(torch.int32))  # -0.0 stays -0.0
    wide = torch.cat([x, torch.randn(8, 3, generator=g)], dim=1)[:, :cols]  # rows `cols + 3` floats apart
    assert all(torch.equal(a, b) for a, b in zip(native.sort_rows(wide), found))


def test_sort_rows_leave_a_nan_to_torch_and_refuse_what_they_do_not_take() -> None:
    require_native()
    x = torch.randn(3, 50)
    x[2, 7] = math.nan
    assert native.sort_rows(x) is None
    for bad in (torch.zeros(2, 0), torch.zeros(4, 3).t(), torch.zeros(1, 3, dtype=torch.float64), torch.zeros(3)):
        with pytest.raises(ValueError, match="sort_rows takes"):
            native.sort_rows(bad)
