"""Weight-only quantized matmuls: the Triton kernels (in the interpreter) against the fp64
dequantize-then-matmul reference, the torch references, int4 packing, and argument checks."""

from __future__ import annotations

import os

import pytest
import torch

from helexa.kernels import quant_reference as qr
from helexa.kernels.quant_matmul import (
    QuantMatmulConfig,
    choose_config,
    int4_matmul,
    int4_matmul_triton,
    int8_matmul,
    int8_matmul_triton,
)
from tests.support.kernels import TOLERANCE, relative_error

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests run in the Triton interpreter"
)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 16, 64), (3, 40, 128), (17, 40, 128)]  # (M, N, K): decode, N past a tile, M past a tile


def _x(m: int, k: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn((m, k), generator=gen).to(dtype)  # (M, K), never zero (almost surely)


def _int8_weight(n: int, k: int, group: int, scale_dtype: torch.dtype, gen: torch.Generator):
    """qweight int8 (N, K) and scales (N,) for group 0 (per-channel) or (N, K // group); scales of
    both signs, bounded away from zero."""
    qweight = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    shape = (n,) if group == 0 else (n, k // group)
    sign = torch.randint(0, 2, shape, generator=gen) * 2 - 1
    scales = ((torch.rand(shape, generator=gen) + 0.5) * sign / 64).to(scale_dtype)
    return qweight, scales


def _int4_weight(n: int, k: int, group: int, scale_dtype: torch.dtype, gen: torch.Generator):
    """qweight uint8 (N, K // 2), scales and zeros (N, K // group)."""
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    sign = torch.randint(0, 2, (n, k // group), generator=gen) * 2 - 1
    scales = ((torch.rand((n, k // group), generator=gen) + 0.5) * sign / 8).to(scale_dtype)
    zeros = (torch.randn((n, k // group), generator=gen) / 4).to(scale_dtype)
    return qr.pack_int4(codes), scales, zeros


def _check_int8(x, qweight, scales, config=None) -> torch.Tensor:
    out = torch.full((x.shape[0], qweight.shape[0]), float("nan"), dtype=x.dtype)  # poisoned
    got = int8_matmul_triton(x, qweight, scales, out=out, config=config)
    assert got is out and not got.isnan().any()
    ref = x.double() @ qr.dequantize_int8(qweight, scales, dtype=torch.float64).T  # (M, N)
    err = relative_error(got, ref)
    assert err < TOLERANCE[x.dtype], f"relative error {err:.2e} >= {TOLERANCE[x.dtype]:.0e}"
    return got


def _check_int4(x, qweight, scales, zeros, config=None) -> torch.Tensor:
    out = torch.full((x.shape[0], qweight.shape[0]), float("nan"), dtype=x.dtype)  # poisoned
    got = int4_matmul_triton(x, qweight, scales, zeros, out=out, config=config)
    assert got is out and not got.isnan().any()
    ref = x.double() @ qr.dequantize_int4(qweight, scales, zeros, dtype=torch.float64).T  # (M, N)
    err = relative_error(got, ref)
    assert err < TOLERANCE[x.dtype], f"relative error {err:.2e} >= {TOLERANCE[x.dtype]:.0e}"
    return got


# ---------------------------------------------------------------------------------------------
# Triton kernels in the interpreter
# ---------------------------------------------------------------------------------------------
@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [0, 32, 64], ids=["channel", "g32", "g64"])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16], ids=["s32", "s16"])
@pytest.mark.parametrize("m,n,k", SHAPES, ids=lambda v: str(v))
def test_int8_matches_fp64_reference(dtype, group, scale_dtype, m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n + k + group)
    _check_int8(_x(m, k, dtype, gen), *_int8_weight(n, k, group, scale_dtype, gen))


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [32, 64], ids=["g32", "g64"])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16], ids=["s32", "s16"])
@pytest.mark.parametrize("m,n,k", SHAPES, ids=lambda v: str(v))
def test_int4_matches_fp64_reference(dtype, group, scale_dtype, m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n + k + group + 1)
    _check_int4(_x(m, k, dtype, gen), *_int4_weight(n, k, group, scale_dtype, gen))


# block_k below the group (one scale per step), equal, and above it (groups broadcast per step);
# split-K into 2 and into 3 uneven shares (7 steps), a block_n past N, a block_m past M.
CONFIGS = {
    "bk32-split2": QuantMatmulConfig(16, 16, 32, split_k=2),
    "bk64-bn64": QuantMatmulConfig(16, 64, 64),
    "bk128-split3": QuantMatmulConfig(32, 16, 128, split_k=3),
}


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_configs_agree(dtype, name):
    """Every valid config gives the reference's result: block_k vs group size, split-K, tile masks."""
    gen = torch.Generator().manual_seed(3)
    m, n, k = 5, 24, 896  # 7 steps of 128, 28 of 32
    x = _x(m, k, dtype, gen)
    cfg = CONFIGS[name]
    for group in (0, 32, 64):
        _check_int8(x, *_int8_weight(n, k, group, torch.float32, gen), config=cfg)
    for group in (32, 64, 128):
        _check_int4(x, *_int4_weight(n, k, group, torch.float32, gen), config=cfg)


@interpreted
def test_more_splits_than_steps():
    """split_k above the number of K steps: only non-empty splits launch, and y is still written."""
    gen = torch.Generator().manual_seed(4)
    x = _x(2, 64, torch.float16, gen)
    for split in (2, 4):
        cfg = QuantMatmulConfig(16, 16, 64, split_k=split)  # one K step
        _check_int8(x, *_int8_weight(24, 64, 32, torch.float32, gen), config=cfg)
        _check_int4(x, *_int4_weight(24, 64, 32, torch.float32, gen), config=cfg)
    cfg = QuantMatmulConfig(16, 16, 32, split_k=16)  # two K steps, 16 splits asked
    _check_int4(x, *_int4_weight(24, 64, 64, torch.float32, gen), config=cfg)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bf16_scales_strided_inputs_and_out(dtype):
    """bf16 scales/zeros; x, out, qweight and scales as non-contiguous views."""
    gen = torch.Generator().manual_seed(9)
    m, n, k = 6, 40, 128
    x = _x(m, 2 * k, dtype, gen)[:, ::2]  # (M, K), column stride 2
    q8, s8 = _int8_weight(n, k, 32, torch.bfloat16, gen)
    q8 = torch.cat([q8, q8], dim=1)[:, :k]  # row stride 2K
    s8 = s8.t().contiguous().t()  # column-major scales
    q4, s4, z4 = _int4_weight(n, k, 64, torch.bfloat16, gen)
    for got, ref in [
        (
            int8_matmul_triton(x, q8, s8, out=torch.full((n, m), float("nan"), dtype=dtype).t()),
            x.double() @ qr.dequantize_int8(q8, s8, dtype=torch.float64).T,
        ),
        (
            int4_matmul_triton(x, q4, s4, z4, out=torch.full((n, m), float("nan"), dtype=dtype).t()),
            x.double() @ qr.dequantize_int4(q4, s4, z4, dtype=torch.float64).T,
        ),
    ]:
        assert relative_error(got, ref) < TOLERANCE[dtype]


@interpreted
def test_empty_batch_and_dispatch(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    q8, s8 = _int8_weight(16, 64, 32, torch.float32, gen)
    assert int8_matmul_triton(torch.empty(0, 64), q8, s8).shape == (0, 16)
    x = _x(2, 64, torch.float32, gen)
    q4, s4, z4 = _int4_weight(16, 64, 32, torch.float32, gen)
    via_triton = int8_matmul(x, q8, s8), int4_matmul(x, q4, s4, z4)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors without the interpreter: the references
    via_torch = int8_matmul(x, q8, s8), int4_matmul(x, q4, s4, z4)
    assert torch.equal(via_torch[0], qr.int8_matmul_reference(x, q8, s8))
    out = torch.full((2, 16), float("nan"))
    assert int4_matmul(x, q4, s4, z4, out=out) is out and torch.equal(out, via_torch[1])
    for a, b in zip(via_triton, via_torch):
        assert relative_error(a, b.double()) < 1e-5


# ---------------------------------------------------------------------------------------------
# references and packing
# ---------------------------------------------------------------------------------------------
def test_pack_layout_and_roundtrip():
    q = torch.tensor([[1, 2, 15, 0], [7, 8, 3, 12]], dtype=torch.uint8)
    packed = qr.pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.tolist() == [[0x21, 0x0F], [0x87, 0xC3]]  # low nibble = even k
    assert torch.equal(qr.unpack_int4(packed), q)
    codes = torch.randint(0, 16, (9, 64), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    assert torch.equal(qr.unpack_int4(qr.pack_int4(codes)), codes)
    assert torch.equal(qr.unpack_int4(qr.pack_int4(codes.long())), codes)


def test_dequantize_by_hand():
    q8 = torch.tensor([[1, -2] * 16 + [3, 4] * 16], dtype=torch.int8)  # (1, 64)
    w = qr.dequantize_int8(q8, torch.tensor([0.5]))
    assert w.dtype == torch.float32 and w[0, :2].tolist() == [0.5, -1.0]
    w = qr.dequantize_int8(q8, torch.tensor([[0.5, 2.0]], dtype=torch.float16))  # G = 32
    assert w[0, :2].tolist() == [0.5, -1.0] and w[0, 32:34].tolist() == [6.0, 8.0]
    codes = torch.tensor([[8, 9, 0, 15] * 8 + [8] * 32], dtype=torch.uint8)  # (1, 64)
    w = qr.dequantize_int4(qr.pack_int4(codes), torch.tensor([[0.5, 1.0]]), torch.tensor([[1.0, -2.0]]))
    assert w[0, :4].tolist() == [1.0, 1.5, -3.0, 4.5] and w[0, 32:].eq(-2.0).all()


def test_references_cast_to_x_dtype():
    gen = torch.Generator().manual_seed(2)
    x = _x(3, 64, torch.bfloat16, gen)
    q8, s8 = _int8_weight(16, 64, 0, torch.float16, gen)
    y = qr.int8_matmul_reference(x, q8, s8)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 16)
    assert relative_error(y, x.double() @ qr.dequantize_int8(q8, s8, dtype=torch.float64).T) < 2e-2
    q4, s4, z4 = _int4_weight(16, 64, 32, torch.float32, gen)
    y = qr.int4_matmul_reference(x.half(), q4, s4, z4)
    assert y.dtype == torch.float16 and y.shape == (3, 16)


# ---------------------------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------------------------
def _bad_int8_cases():
    x, q, s = torch.randn(2, 64), torch.zeros(16, 64, dtype=torch.int8), torch.ones(16)
    return [
        ((x, q.to(torch.uint8), s), "int8 qweight must be"),
        ((x, q, torch.ones(8)), "per-channel scales must be"),
        ((x, q, torch.ones(16, 3)), "does not divide K"),
        ((x, q, torch.ones(16, 4)), "group size G = 16 must be a multiple of 32"),
        ((x, q, torch.ones(16, dtype=torch.int32)), "scales must be float32"),
        ((x.double(), q, s), "x must be float32"),
        ((torch.randn(2, 32), q, s), "x has K = 32"),
        ((torch.randn(64), q, s), "x must be 2-D"),
        ((torch.randn(2, 48), torch.zeros(16, 48, dtype=torch.int8), s), "K = 48 must be a positive multiple of 32"),
    ]


def _bad_int4_cases():
    x, q, s = torch.randn(2, 64), torch.zeros(16, 32, dtype=torch.uint8), torch.ones(16, 2)
    return [
        ((x, q.to(torch.int8), s, s), "int4 qweight must be"),
        ((x, q, torch.ones(16), torch.ones(16)), "int4 scales must be"),
        ((x, q, s, torch.ones(16, 1)), "zeros shape"),
        ((x, q, torch.ones(16, 4), torch.ones(16, 4)), "group size G = 16"),
        ((torch.randn(2, 48), torch.zeros(16, 24, dtype=torch.uint8), torch.ones(16, 1), torch.ones(16, 1)),
         "K = 48 must be a positive multiple of 32"),
        ((x, q, s, s.to(torch.int64)), "zeros must be float32"),
    ]  # fmt: skip


@pytest.mark.parametrize("case", range(len(_bad_int8_cases())))
def test_int8_bad_arguments_raise(case):
    args, match = _bad_int8_cases()[case]
    with pytest.raises(ValueError, match=match):
        qr.int8_matmul_reference(*args)
    with pytest.raises(ValueError, match=match):
        int8_matmul_triton(*args)


@pytest.mark.parametrize("case", range(len(_bad_int4_cases())))
def test_int4_bad_arguments_raise(case):
    args, match = _bad_int4_cases()[case]
    with pytest.raises(ValueError, match=match):
        qr.int4_matmul_reference(*args)
    with pytest.raises(ValueError, match=match):
        int4_matmul_triton(*args)


def test_bad_out_config_and_packing_raise():
    x, q, s = torch.randn(2, 64), torch.zeros(16, 64, dtype=torch.int8), torch.ones(16, 2)
    with pytest.raises(ValueError, match="out must be"):
        int8_matmul_triton(x, q, s, out=torch.empty(2, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="block_k 64 must divide"):  # G = 96: neither divides the other
        int8_matmul_triton(torch.randn(2, 192), torch.zeros(16, 192, dtype=torch.int8), torch.ones(16, 2),
            config=QuantMatmulConfig(16, 16, 64))  # fmt: skip
    with pytest.raises(ValueError, match="block_k must be"):
        int8_matmul_triton(x, q, s, config=QuantMatmulConfig(16, 16, 128))
    with pytest.raises(ValueError, match="powers of two"):
        int8_matmul_triton(x, q, s, config=QuantMatmulConfig(8, 16, 32))
    with pytest.raises(ValueError, match="values must lie in"):
        qr.pack_int4(torch.tensor([[3, 16]]))
    with pytest.raises(ValueError, match="even number of columns"):
        qr.pack_int4(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="2-D uint8"):
        qr.unpack_int4(torch.zeros(2, 3, dtype=torch.int8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("n,k,group", [(4096, 4096, 128), (14336, 4096, 32), (4096, 14336, 0), (40, 96, 32)])
def test_choose_config_is_valid(n, k, group, dtype):
    cfg = choose_config(n, k, group, num_sms=132, dtype=dtype)
    assert k % cfg.block_k == 0 and (group == 0 or group % cfg.block_k == 0 or cfg.block_k % group == 0)
    steps = k // cfg.block_k
    per_split = -(-steps // cfg.split_k)
    assert 1 <= cfg.split_k <= 16 and (cfg.split_k - 1) * per_split < steps  # no split is empty
    assert cfg.block_m == 16 and cfg.split_k & (cfg.split_k - 1) == 0 or cfg.split_k == -(-steps // per_split)


@interpreted
@pytest.mark.parametrize("kind", ["int8 per-channel", "int8 G32", "int4 G32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_row_s_result_does_not_depend_on_how_many_rows_share_the_matmul(kind, dtype):
    """Rows of an M-row product are bit for bit the same rows computed alone, for M across the old
    decode / mid / prefill tile choices (1..80): the default config never follows M (it did, and rows
    changed from M = 64 on in the first GPU run and in the interpreter alike)."""
    gen = torch.Generator().manual_seed(11)
    n, k = 48, 256
    x = _x(80, k, dtype, gen)
    if kind.startswith("int4"):
        qweight, scales, zeros = _int4_weight(n, k, 32, torch.float16, gen)

        def matmul(rows):
            return int4_matmul_triton(rows, qweight, scales, zeros)
    else:
        qweight, scales = _int8_weight(n, k, 0 if "per-channel" in kind else 32, torch.float16, gen)

        def matmul(rows):
            return int8_matmul_triton(rows, qweight, scales)

    alone = torch.cat([matmul(x[i : i + 1]) for i in range(3)])
    for m in (3, 5, 16, 17, 33, 64, 80):
        assert torch.equal(matmul(x[:m])[:3], alone), f"M = {m}"
