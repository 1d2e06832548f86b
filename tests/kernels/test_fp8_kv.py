"""fp8 (e4m3) KV caches: `write_kv` quantizes, `paged_attention` dequantizes, with one float32 scale
per KV head for K and V — the Triton kernels (in the interpreter) against the torch references, and
the references against float64 oracles.

The interpreter reads the e4m3 NaN code as 480 rather than NaN, so a poisoned fp8 row read by
mistake shows up as a large wrong value, not as NaN; outputs are still poisoned with NaN.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import helexa.kernels as kernels
from helexa.kernels import FP8_KV_DTYPE, FP8_KV_MAX, reference, write_kv_triton
from helexa.kernels.attention import paged_attention_triton
from helexa.kvcache import fp8_scales
from tests.support.kernels import TOLERANCE, make_problem, relative_error

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests run in the Triton interpreter"
)

# decode (1 token after a prefix), prefill from empty, extend (a chunk after a prefix), lengths that
# end mid-block, a prefill shorter than a block; two decodes take the reference's batched decode path.
MIXED = [(37, 1), (0, 23), (18, 9), (5, 1), (0, 3)]
DECODE = [(40, 1), (3, 1), (17, 1)]
PREFILL = [(0, 19), (0, 5)]
EXTEND = [(16, 7), (9, 12)]
SHAPES = {"mixed": MIXED, "decode": DECODE, "prefill": PREFILL, "extend": EXTEND}
# Error of fp8 attention against the unquantized float64 oracle on random inputs. e4m3 keeps 3
# mantissa bits: each element is off by up to 2^-4 of itself (about 3.6% RMS), which V passes
# straight to the output; K's error moves the softmax, most where it is peaked (heads scaled up).
FP8_RMS_TOLERANCE = 0.06  # RMS error / RMS of the oracle (measured 0.03-0.05)
FP8_MAX_TOLERANCE = 0.2  # max error / max of the oracle (measured 0.04-0.15)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _fp8_problem(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    """A paged problem whose K/V heads have very different magnitudes (head h times 4^h), calibrated
    per head (amax x 2 / 448) and quantized; rows past each sequence's end are NaN (an e4m3 NaN)."""
    p = make_problem(seqs, num_heads, num_kv_heads, head_dim, block_size, torch.float32, seed=seed)
    magnitude = 4.0 ** torch.arange(num_kv_heads, dtype=torch.float32)[:, None]  # (KVH, 1)
    k_full, v_full = p.k_cache * magnitude, p.v_cache * (0.5 * magnitude)
    k_scale = fp8_scales(k_full.nan_to_num(0.0).abs().amax(dim=(0, 1, 3)))
    v_scale = fp8_scales(v_full.nan_to_num(0.0).abs().amax(dim=(0, 1, 3)))
    k8, v8 = reference.quantize_fp8(k_full, k_scale), reference.quantize_fp8(v_full, v_scale)
    q = p.q.to(dtype)
    index = (p.block_tables, p.seq_lens, p.query_start_loc)
    return q, k8, v8, k_scale, v_scale, index, (k_full, v_full)


def _dequantized_oracle(q, k8, v8, k_scale, v_scale, index):
    """float64 attention over the dequantized cache (exact: every e4m3 value times a float32 scale is a float64)."""
    k64 = reference.dequantize_fp8(k8, k_scale, torch.float64)
    v64 = reference.dequantize_fp8(v8, v_scale, torch.float64)
    return reference.paged_attention(q.double(), k64, v64, *index)


# --- write_kv: quantization ----------------------------------------------------------------------


def test_triton_quantization_equals_torch_cast_bit_for_bit():
    """Every finite e4m3 value, every midpoint between neighbours (ties to even), subnormals, -0.0,
    values past ±448 and ±inf: the kernel's bytes equal `reference.quantize_fp8`'s (torch's cast)."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_KV_DTYPE).float()
    grid = codes[torch.isfinite(codes)].unique()  # (253,) sorted
    mids = (grid[1:] + grid[:-1]) / 2
    gen = torch.Generator().manual_seed(0)
    extra = torch.tensor([-0.0, 1.9375, 15.5, 1.0625, 1e-3, 2.0**-10, 460.0, 470.0, 500.0, 1e9, -1e9])
    extra = torch.cat([extra, torch.tensor([float("inf"), float("-inf")])])
    x = torch.cat([grid, mids, extra, torch.randn(600, generator=gen) * 60, torch.randn(600, generator=gen) * 0.01])
    x = x[: x.numel() // 32 * 32].view(-1, 2, 16)  # (T, KVH=2, D=16)
    slots = torch.arange(x.shape[0])
    for scale in ([1.0, 1.0], [0.37, 3.0], [2.0**-7, 1e-4]):
        s = torch.tensor(scale)
        got = [torch.full((x.shape[0], 1, 2, 16), float("nan")).to(FP8_KV_DTYPE) for _ in range(2)]
        want = [c.clone() for c in got]
        write_kv_triton(x, -x, *got, slots, k_scale=s, v_scale=s.flip(0))
        reference.write_kv(x, -x, *want, slots, k_scale=s, v_scale=s.flip(0))
        assert torch.equal(_bytes(got[0]), _bytes(want[0])) and torch.equal(_bytes(got[1]), _bytes(want[1]))
        assert not torch.isnan(got[0].float()).any()


def test_values_beyond_the_calibrated_range_saturate_instead_of_becoming_inf_or_nan():
    """Scales calibrated on |x| <= 1; then K/V 1000x larger (and inf) arrive: the cache holds ±448
    (the top of e4m3), attention stays finite, in the reference and in the Triton kernels alike."""
    gen = torch.Generator().manual_seed(1)
    kvh, d, bs = 2, 32, 8
    scale = fp8_scales(torch.ones(kvh))  # calibrated amax 1.0 -> scale 2/448
    k = torch.randn(12, kvh, d, generator=gen).clamp(-1, 1)
    v = torch.randn(12, kvh, d, generator=gen).clamp(-1, 1)
    k[3:6] *= 1000.0
    v[3:6] *= -1000.0
    k[7, 0, 0], v[8, 1, 1] = float("inf"), float("-inf")
    slots = torch.arange(12)
    qsl = torch.tensor([0, 12], dtype=torch.int32)
    table, lens = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([12], dtype=torch.int32)
    q = torch.randn(12, 4, d, generator=gen)
    for write, attend in ((reference.write_kv, reference.paged_attention), (write_kv_triton, paged_attention_triton)):
        kc = torch.zeros(2, bs, kvh, d, dtype=FP8_KV_DTYPE)
        vc = kc.clone()
        write(k, v, kc, vc, slots, k_scale=scale, v_scale=scale)
        kf, vf = kc.float().flatten(0, 1)[:12], vc.float().flatten(0, 1)[:12]
        assert torch.isfinite(kf).all() and torch.isfinite(vf).all()
        big_k, big_v = (x[3:6].abs() > FP8_KV_MAX * scale[:, None] for x in (k, v))
        assert big_k.sum() > 100 and big_v.sum() > 100
        assert (kf[3:6].abs()[big_k] == FP8_KV_MAX).all() and (vf[3:6].abs()[big_v] == FP8_KV_MAX).all()
        assert kf[7, 0, 0] == FP8_KV_MAX and vf[8, 1, 1] == -FP8_KV_MAX
        out = attend(q, kc, vc, table, lens, qsl, k_scale=scale, v_scale=scale, out=torch.full_like(q, float("nan")))
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_write_kv_matches_reference_skips_minus_one_and_touches_nothing_else(dtype):
    gen = torch.Generator().manual_seed(2)
    num_blocks, block_size, kvh, d, tokens = 7, 8, 3, 80, 13
    k = (torch.randn(tokens, kvh, d, generator=gen) * torch.tensor([0.1, 5.0, 40.0])[:, None]).to(dtype)
    v = (torch.randn(tokens, kvh, d, generator=gen) * torch.tensor([3.0, 0.02, 1.0])[:, None]).to(dtype)
    k_scale = fp8_scales(k.float().abs().amax(dim=(0, 2)))
    v_scale = fp8_scales(v.float().abs().amax(dim=(0, 2)))
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[2, 9]] = -1
    poison = torch.full((num_blocks, block_size, kvh, d), float("nan")).to(FP8_KV_DTYPE)
    got, want = [poison.clone(), poison.clone()], [poison.clone(), poison.clone()]
    write_kv_triton(k, v, *got, slots, k_scale=k_scale, v_scale=v_scale)
    reference.write_kv(k, v, *want, slots, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(_bytes(got[0]), _bytes(want[0])) and torch.equal(_bytes(got[1]), _bytes(want[1]))
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    for cache in got:  # written rows are finite, every other row still holds the poison
        rows = cache.float().flatten(0, 1)  # (NB*BS, KVH, D)
        assert torch.isfinite(rows[written]).all() and torch.isnan(rows[~written]).all()
    # dequantized rows are within e4m3's half-ulp (2^-4 relative) of the input, or its subnormal step
    rows = got[0].float().flatten(0, 1)[slots[slots >= 0]] * k_scale[:, None]
    exact = k[slots >= 0].float()
    assert ((rows - exact).abs() <= exact.abs() * 2.0**-4 + k_scale[:, None] * 2.0**-10).all()


def test_public_write_kv_and_paged_attention_pass_the_scales_on():
    q, k8, v8, k_scale, v_scale, index, _ = _fp8_problem(MIXED, 4, 2, 32, 8, torch.float32, seed=3)
    got = kernels.paged_attention(q, k8, v8, *index, k_scale=k_scale, v_scale=v_scale)
    want = reference.paged_attention(q, k8, v8, *index, k_scale=k_scale, v_scale=v_scale)
    assert relative_error(got, want) < TOLERANCE[torch.float32]
    k_cache, v_cache = torch.zeros_like(k8), torch.zeros_like(v8)
    kernels.write_kv(q[:, :2], q[:, 2:], k_cache, v_cache, torch.arange(q.shape[0]), k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(_bytes(k_cache.flatten(0, 1)[: q.shape[0]]), _bytes(reference.quantize_fp8(q[:, :2], k_scale)))


# --- paged_attention: dequantization ---------------------------------------------------------------


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("split_keys", [512, 16], ids=["onesplit", "split16"])
def test_triton_attention_matches_the_dequantized_oracle(shape, dtype, split_keys):
    q, k8, v8, k_scale, v_scale, index, _ = _fp8_problem(SHAPES[shape], 8, 2, 64, 16, dtype, seed=len(shape))
    out = torch.full_like(q, float("nan"))  # poisoned: every output row must be written
    got = paged_attention_triton(
        q, k8, v8, *index, out=out, k_scale=k_scale, v_scale=v_scale, tile_n=16, split_keys=split_keys
    )
    assert got is out and torch.isfinite(got).all()
    assert relative_error(got, _dequantized_oracle(q, k8, v8, k_scale, v_scale, index)) < TOLERANCE[dtype]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 32), (6, 2, 48), (4, 1, 64)])
def test_triton_attention_gqa_and_padded_head_dims(num_heads, num_kv_heads, head_dim):
    q, k8, v8, k_scale, v_scale, index, _ = _fp8_problem(MIXED, num_heads, num_kv_heads, head_dim, 8, torch.float16, 5)
    out = torch.full_like(q, float("nan"))
    got = paged_attention_triton(q, k8, v8, *index, k_scale=k_scale, v_scale=v_scale, out=out)
    want = reference.paged_attention(q, k8, v8, *index, k_scale=k_scale, v_scale=v_scale)
    assert relative_error(got, want) < TOLERANCE[torch.float16]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_reference_fp8_against_float64_oracles(shape):
    """The reference's float32 paths (fused prefill, masked extend, batched decode) on an fp8 cache:
    against float64 of the same dequantized values, float32 accuracy; against float64 of the
    unquantized K/V, the error of e4m3 itself."""
    q, k8, v8, k_scale, v_scale, index, (k_full, v_full) = _fp8_problem(SHAPES[shape], 8, 2, 64, 16, torch.float32, 7)
    out = torch.full_like(q, float("nan"))
    got = reference.paged_attention(q, k8, v8, *index, k_scale=k_scale, v_scale=v_scale, out=out)
    assert got is out and torch.isfinite(got).all()
    dequantized = _dequantized_oracle(q, k8, v8, k_scale, v_scale, index)
    assert relative_error(got, dequantized) < TOLERANCE[torch.float32]
    unquantized = reference.paged_attention(q.double(), k_full.double(), v_full.double(), *index)
    rms = float((got.double() - unquantized).pow(2).mean().sqrt() / unquantized.pow(2).mean().sqrt())
    assert 0.005 < rms < FP8_RMS_TOLERANCE, rms  # (0.005: the cache really is quantized)
    assert relative_error(got, unquantized) < FP8_MAX_TOLERANCE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_write_then_attend_triton_equals_reference(dtype):
    """The model's order of calls: a step writes its new tokens' K/V, then attends over the cache."""
    seqs = [(21, 1), (0, 14), (9, 6)]
    q, _, _, k_scale, v_scale, index, (k_full, v_full) = _fp8_problem(seqs, 4, 2, 32, 8, dtype, seed=11)
    block_tables, seq_lens, qsl = index
    slots = []
    for b, (prefix, q_len) in enumerate(seqs):  # the new tokens' slots
        for pos in range(prefix, prefix + q_len):
            slots.append(int(block_tables[b, pos // 8]) * 8 + pos % 8)
    slot_mapping = torch.tensor(slots)
    gen = torch.Generator().manual_seed(12)
    k_new = (torch.randn(len(slots), 2, 32, generator=gen) * 3).to(dtype)
    v_new = torch.randn(len(slots), 2, 32, generator=gen).to(dtype)
    outs = []
    for write, attend in ((reference.write_kv, reference.paged_attention), (write_kv_triton, paged_attention_triton)):
        k8 = reference.quantize_fp8(k_full, k_scale)
        v8 = reference.quantize_fp8(v_full, v_scale)
        write(k_new, v_new, k8, v8, slot_mapping, k_scale=k_scale, v_scale=v_scale)
        outs.append(attend(q, k8, v8, *index, k_scale=k_scale, v_scale=v_scale, out=torch.full_like(q, float("nan"))))
    assert torch.isfinite(outs[1]).all()
    assert relative_error(outs[1], outs[0]) < TOLERANCE[dtype]


# --- argument checks ------------------------------------------------------------------------------


def _small():
    return _fp8_problem([(3, 1)], 4, 2, 16, 8, torch.float32, seed=0)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(k_scale=None), "needs k_scale"),
        (dict(k_scale=None, v_scale=None), "needs k_scale and v_scale"),
        (dict(k_scale=torch.ones(3)), r"k_scale must be \[2\]"),
        (dict(v_scale=torch.ones(2, dtype=torch.float64)), "v_scale must be float32"),
        (dict(k_scale=torch.tensor([1.0, 0.0])), "finite and > 0"),
        (dict(v_scale=torch.tensor([1.0, float("nan")])), "finite and > 0"),
    ],
    ids=["no-k", "none", "shape", "dtype", "zero", "nan"],
)
def test_bad_scales_raise_value_error(change, match):
    q, k8, v8, k_scale, v_scale, index, _ = _small()
    scales = {**dict(k_scale=k_scale, v_scale=v_scale), **change}
    for attend in (reference.paged_attention, paged_attention_triton):
        with pytest.raises(ValueError, match=match):
            attend(q, k8, v8, *index, **scales)
    for write in (reference.write_kv, write_kv_triton):
        with pytest.raises(ValueError, match=match):
            write(q[:1, :2], q[:1, 2:], k8, v8, torch.tensor([0]), **scales)


def test_scales_with_an_unquantized_cache_and_mixed_cache_dtypes_raise():
    q, k8, v8, k_scale, v_scale, index, _ = _small()
    k32, v32 = k8.float(), v8.float()
    with pytest.raises(ValueError, match="apply to an fp8"):
        reference.paged_attention(q, k32, v32, *index, k_scale=k_scale, v_scale=v_scale)
    with pytest.raises(ValueError, match="apply to an fp8"):
        write_kv_triton(q[:1, :2], q[:1, 2:], k32, v32, torch.tensor([0]), k_scale=k_scale)
    with pytest.raises(ValueError, match="dtype"):
        paged_attention_triton(q, k8, v32, *index, k_scale=k_scale, v_scale=v_scale)
    with pytest.raises(ValueError, match="unsupported dtype"):  # Triton takes fp32/fp16/bf16 activations
        k64 = q[:1, :2].double()
        write_kv_triton(k64, k64, k8, v8, torch.tensor([0]), k_scale=k_scale, v_scale=v_scale)


def test_unquantized_calls_are_unchanged():
    """Without scales every kernel behaves as before (positional signatures included)."""
    p = make_problem(MIXED, 4, 2, 32, 8, torch.float32, seed=4)
    got = paged_attention_triton(*p.args(), None, torch.full_like(p.q, float("nan")))
    assert relative_error(got, reference.paged_attention(*p.args_fp64())) < TOLERANCE[torch.float32]


# --- sm_90 compile --------------------------------------------------------------------------------


def test_fp8_kernels_compile_for_h200():
    """The fp8 variants compile for sm_90 (no GPU needed): e4m3 conversions in the PTX, K/V loads still
    software-pipelined, prefill tiles of half-precision queries still on wgmma."""
    pytest.importorskip("triton.backends.nvidia.compiler", reason="triton's CUDA backend is not installed")
    here = Path(__file__).parent
    repo = here.parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(repo), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(here / "_compile_sm90_fp8.py")], env=env, cwd=repo, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.fail(f"compiling the fp8 kernels for sm_90 failed:\n{proc.stderr[-4000:]}")
    results = {r["name"]: r for r in map(json.loads, proc.stdout.splitlines())}
    assert len(results) == 6
    for name, r in results.items():
        assert r["fp8_cvt"] and r["global_store"] and r["shared"] <= 232_448, name
        if "write_kv" not in name:
            assert r["async_copy"], name
        if "prefill" in name and "fp32" not in name:
            assert r["wgmma"], name
