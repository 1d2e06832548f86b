"""The batch-invariant dense matmul (`helexa.kernels.dense_matmul`, behind `helexa.kernels.linear`) in the
Triton interpreter: against the float64 product, the same bits for a row whatever the number of rows,
and F.linear itself off CUDA."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from helexa.kernels import linear
from helexa.kernels.dense_matmul import dense_config, dense_matmul_triton
from helexa.kernels.quant_matmul import QuantMatmulConfig
from tests.support.kernels import TOLERANCE, relative_error

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests run in the Triton interpreter"
)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (M, N, K): decode, N past a tile, M past a tile, K not a multiple of any BLOCK_K
SHAPES = [(1, 40, 64), (3, 150, 128), (19, 40, 200), (70, 33, 96)]
CONFIGS = {
    "default": None,
    "16x16x16 split 3": QuantMatmulConfig(16, 16, 16, split_k=3, num_warps=4, num_stages=2),
    "32x64x32 unsplit": QuantMatmulConfig(32, 64, 32, split_k=1, num_warps=4, num_stages=2),
}


def _operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((m, k), generator=gen).to(dtype)  # never zero (almost surely)
    w = (torch.randn((n, k), generator=gen) / k**0.5).to(dtype)
    return x, w


@interpreted
@pytest.mark.parametrize("config", list(CONFIGS), ids=str)
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_the_float64_product_and_writes_every_element(dtype, m, n, k, config):
    x, w = _operands(m, n, k, dtype, seed=m * 7 + k)
    out = torch.full((m, n), float("nan"), dtype=dtype)  # poisoned
    got = dense_matmul_triton(x, w, out=out, config=CONFIGS[config])
    assert got is out and not got.isnan().any()
    err = relative_error(got, x.double() @ w.double().T)
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


@interpreted
def test_strided_operands_and_a_fresh_output():
    x, w = _operands(9, 48, 128, torch.float32, seed=3)
    x_t = x.T.contiguous().T  # column-major: strides (1, M)
    w_wide = torch.cat([w, w], dim=1)[:, :128]  # row stride 256
    got = dense_matmul_triton(x_t, w_wide)
    assert relative_error(got, x.double() @ w.double().T) < TOLERANCE[torch.float32]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_row_s_result_does_not_depend_on_how_many_rows_share_the_matmul(dtype):
    """The first rows of M-row products are bit for bit those rows computed alone, M = 3 .. 130 (past
    one and two M tiles of every default config): the config never follows M."""
    x, w = _operands(130, 72, 192, dtype, seed=5)
    alone = torch.cat([dense_matmul_triton(x[i : i + 1], w) for i in range(3)])
    for m in (3, 7, 16, 17, 64, 65, 130):
        assert torch.equal(dense_matmul_triton(x[:m], w)[:3], alone), f"M = {m}"


def test_off_cuda_the_layers_keep_f_linear():
    x, w = _operands(5, 24, 32, torch.float32, seed=1)
    bias = torch.randn(24)
    assert torch.equal(linear(x.view(5, 1, 32), w, bias), F.linear(x.view(5, 1, 32), w, bias))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("n,k", [(2048, 8192), (3072, 2048), (32000, 2048), (40, 96), (576, 576)])
def test_the_config_splits_k_evenly_into_a_power_of_two(n, k, dtype):
    cfg = dense_config(n, k, num_sms=132, dtype=dtype)
    steps = -(-k // cfg.block_k)
    per_split = -(-steps // cfg.split_k)
    assert 1 <= cfg.split_k <= 16 and (cfg.split_k - 1) * per_split < steps  # no split is empty
    if cfg.split_k * per_split == steps:
        assert cfg.split_k & (cfg.split_k - 1) == 0


@pytest.mark.parametrize(
    "x, w, match",
    [
        (torch.zeros(2, 8), torch.zeros(4, 9), "must be"),
        (torch.zeros(2, 8), torch.zeros(4, 8, dtype=torch.float16), "share one of"),
        (torch.zeros(2, 8, dtype=torch.int32), torch.zeros(4, 8, dtype=torch.int32), "share one of"),
        (torch.zeros(8), torch.zeros(4, 8), "must be"),
    ],
)
def test_bad_operands_are_refused(x, w, match):
    with pytest.raises(ValueError, match=match):
        dense_matmul_triton(x, w)
    with pytest.raises(ValueError, match="out must be"):
        dense_matmul_triton(torch.zeros(2, 8), torch.zeros(4, 8), out=torch.zeros(4, 2))
