"""Triton paged_attention (in the interpreter) against the fp64 torch reference."""

from __future__ import annotations

import os

import pytest
import torch

import helexa.kernels as kernels
from helexa.kernels import reference
from helexa.kernels.attention import SPLIT_KEYS, paged_attention_triton
from tests.support.kernels import TOLERANCE, make_problem, relative_error

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests run in the Triton interpreter"
)

# decode (1 token after a prefix), prefill from empty (no prefix), extend (chunk after a prefix),
# lengths that end mid-block, and a prefill chunk shorter than a block.
MIXED = [(37, 1), (0, 23), (18, 9), (5, 1), (0, 3)]
DECODE = [(40, 1), (3, 1), (17, 1)]


def _check(problem, dtype, **kwargs) -> torch.Tensor:
    out = torch.full_like(problem.q, float("nan"))  # poisoned: every output row must be written
    got = paged_attention_triton(*problem.args(), out=out, **kwargs)
    assert got is out
    ref = reference.paged_attention(*problem.args_fp64())
    err = relative_error(got, ref)
    assert err < TOLERANCE[dtype], f"relative error {err:.2e} >= {TOLERANCE[dtype]:.0e}"
    return got


@pytest.mark.parametrize(
    "num_heads,num_kv_heads",
    [(4, 4), (4, 2), (8, 2), (16, 2), (4, 1), (6, 2)],
    ids=["mha", "gqa2", "gqa4", "gqa8", "mqa", "gqa3"],
)
@pytest.mark.parametrize("split_keys", [SPLIT_KEYS, 16], ids=["onesplit", "split16"])
@pytest.mark.parametrize("seqs", [MIXED, DECODE], ids=["mixed", "decode"])
def test_gqa_ratios(num_heads, num_kv_heads, split_keys, seqs):
    """Mixed batches fold their splits in the program; decode batches run them as programs and reduce."""
    p = make_problem(seqs, num_heads, num_kv_heads, 64, 16, torch.float32, seed=num_heads * 7 + num_kv_heads)
    _check(p, torch.float32, tile_n=16, split_keys=split_keys)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_dtypes_and_head_dims(dtype, head_dim):
    p = make_problem(MIXED, 8, 2, head_dim, 16, dtype, seed=head_dim)
    _check(p, dtype)


@pytest.mark.parametrize("head_dim", [80, 96, 256])
def test_padded_head_dims(head_dim):
    p = make_problem([(21, 1), (0, 12), (9, 4)], 4, 2, head_dim, 8, torch.float16, seed=head_dim)
    _check(p, torch.float16)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("tile_n", [16, 64], ids=["tile16", "tile64"])
def test_tile_size_independent_of_block_size(block_size, tile_n):
    p = make_problem(MIXED, 4, 2, 64, block_size, torch.bfloat16, seed=block_size + tile_n)
    _check(p, torch.bfloat16, tile_n=tile_n, split_keys=tile_n)


def _alone(p, b: int, **knobs) -> torch.Tensor:
    """Sequence b of problem p computed by itself."""
    s, e = int(p.query_start_loc[b]), int(p.query_start_loc[b + 1])
    return paged_attention_triton(
        p.q[s:e], p.k_cache, p.v_cache, p.block_tables[b : b + 1], p.seq_lens[b : b + 1],
        torch.tensor([0, e - s], dtype=torch.int32), **knobs,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_query_gets_the_same_bits_in_any_batch(dtype):
    """Batch invariance: every query of a mixed batch (decode, prefill, extend) equals its sequence
    computed alone and, as a decode row (the split launch and its reduce), its own position computed
    in a batch of decodes, bit for bit. Contexts span several splits of 16 keys."""
    knobs = dict(tile_n=16, split_keys=16)
    seqs = [(37, 1), (0, 23), (18, 9), (40, 3), (0, 3)]
    p = make_problem(seqs, 8, 2, 32, 8, dtype, seed=13)
    batch = paged_attention_triton(*p.args(), **knobs)
    for b in range(len(seqs)):
        s, e = int(p.query_start_loc[b]), int(p.query_start_loc[b + 1])
        assert torch.equal(_alone(p, b, **knobs), batch[s:e])
    # every query as a decode row: seq_lens cut at its position, one query per sequence
    rows = list(range(int(p.query_start_loc[-1])))
    owner = [b for b in range(len(seqs)) for _ in range(seqs[b][1])]
    pos = [seqs[b][0] + i for b in range(len(seqs)) for i in range(seqs[b][1])]
    decode = paged_attention_triton(
        p.q, p.k_cache, p.v_cache, p.block_tables[owner].contiguous(),
        torch.tensor([x + 1 for x in pos], dtype=torch.int32), torch.arange(len(rows) + 1, dtype=torch.int32), **knobs,
    )  # fmt: skip
    assert torch.equal(decode, batch)


def test_a_split_dependent_merge_would_be_caught():
    """The invariance test's own check: folding the splits in another order (what a split count sized
    by the batch amounts to) changes bits, so the comparison above can fail."""
    p = make_problem([(40, 1)], 8, 2, 32, 8, torch.float32, seed=2)
    by16 = paged_attention_triton(*p.args(), tile_n=16, split_keys=16)
    by32 = paged_attention_triton(*p.args(), tile_n=16, split_keys=32)
    assert not torch.equal(by16, by32)
    assert relative_error(by16, reference.paged_attention(*p.args_fp64())) < TOLERANCE[torch.float32]


def test_small_query_tiles_span_many_tiles_per_sequence():
    """block_m=16 with GQA 4 gives 4-query tiles: a 23-token prefill spans 6 tiles."""
    p = make_problem(MIXED, 8, 2, 64, 16, torch.float32, seed=11)
    _check(p, torch.float32, block_m=16, tile_n=16)


def test_strided_q_and_out_and_custom_scale():
    """q as a view of a fused QKV projection, out as a view of a wider buffer, explicit scale."""
    p = make_problem(MIXED, 4, 2, 64, 16, torch.float32, seed=5)
    qkv = torch.randn(p.q.shape[0], 8, 64)
    qkv[:, :4] = p.q
    q = qkv[:, :4]  # (T, 4, 64), token stride 8*64
    out_buf = torch.full((p.q.shape[0], 4, 96), float("nan"))
    out = out_buf[:, :, 16:80]
    paged_attention_triton(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, p.query_start_loc, 0.3, out)
    ref = reference.paged_attention(*p.args_fp64(), scale=0.3)
    assert relative_error(out, ref) < TOLERANCE[torch.float32]
    assert out_buf[:, :, :16].isnan().all() and out_buf[:, :, 80:].isnan().all()


def test_int64_index_tensors():
    p = make_problem(DECODE, 4, 2, 64, 8, torch.float32, seed=9)
    out = paged_attention_triton(
        p.q, p.k_cache, p.v_cache, p.block_tables.long(), p.seq_lens.long(), p.query_start_loc.long()
    )
    assert relative_error(out, reference.paged_attention(*p.args_fp64())) < 1e-4


def test_large_pool_needs_64bit_offsets():
    """A real pool of more than 2^31 elements per cache, read and written near its top.

    The tensors come from torch.empty and only the touched pages are ever materialised, so this
    costs a few MiB of memory. Block 1_048_600 starts at element 1_048_600 * 16 * 2 * 64 ~ 2^31 + 2^16:
    with 32-bit offsets the kernels would read and write the wrong rows (or fault).
    """
    block_size, kv_heads, head_dim = 16, 2, 64
    num_blocks = (1 << 31) // (block_size * kv_heads * head_dim) + 64
    try:
        k_cache = torch.empty((num_blocks, block_size, kv_heads, head_dim), dtype=torch.float16)
        v_cache = torch.empty((num_blocks, block_size, kv_heads, head_dim), dtype=torch.float16)
    except RuntimeError as exc:  # the OS refused 2 x 4 GiB of (lazily committed) address space
        pytest.skip(f"cannot reserve a >2^31-element pool here: {exc}")
    assert k_cache.numel() > 2**31
    top = [num_blocks - 1, num_blocks - 40, 7, num_blocks - 3]  # one low block among high ones
    seq_len = len(top) * block_size - 5
    gen = torch.Generator().manual_seed(1)
    k = torch.randn((seq_len, kv_heads, head_dim), generator=gen).half()
    v = torch.randn((seq_len, kv_heads, head_dim), generator=gen).half()
    slots = torch.tensor([top[i // block_size] * block_size + i % block_size for i in range(seq_len)])
    kernels.write_kv_triton(k, v, k_cache, v_cache, slots)
    blocks = torch.tensor(top)
    assert torch.equal(k_cache[blocks].reshape(-1, kv_heads, head_dim)[:seq_len], k)
    assert torch.equal(v_cache[blocks].reshape(-1, kv_heads, head_dim)[:seq_len], v)

    q = torch.randn((6, 4, head_dim), generator=gen).half()  # a 5-token extend and a 1-token decode
    table = torch.tensor([top, top], dtype=torch.int32)
    seq_lens = torch.tensor([seq_len, seq_len - 10], dtype=torch.int32)
    qsl = torch.tensor([0, 5, 6], dtype=torch.int32)
    out = paged_attention_triton(q, k_cache, v_cache, table, seq_lens, qsl, tile_n=16, split_keys=16)
    k_small = torch.zeros((len(top), block_size, kv_heads, head_dim), dtype=torch.float64)
    v_small = torch.zeros_like(k_small)
    k_small.view(-1, kv_heads, head_dim)[:seq_len] = k.double()
    v_small.view(-1, kv_heads, head_dim)[:seq_len] = v.double()
    small_table = torch.arange(len(top), dtype=torch.int32).expand(2, -1).contiguous()
    ref = reference.paged_attention(q.double(), k_small, v_small, small_table, seq_lens, qsl)
    assert relative_error(out, ref) < TOLERANCE[torch.float16]


def test_empty_batch_returns_out_untouched():
    p = make_problem([(4, 1)], 4, 2, 64, 8, torch.float32)
    q = p.q[:0]
    out = paged_attention_triton(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, torch.zeros(2, dtype=torch.int32))
    assert out.shape == (0, 4, 64)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: a.update(q=a["q"][:, :3]), "multiple of num_kv_heads"),
        (lambda a: a.update(q=a["q"].half()), "dtype"),
        (lambda a: a.update(q=a["q"].double()), "unsupported dtype"),
        (lambda a: a.update(v_cache=a["v_cache"][:, :4]), "v_cache shape"),
        (lambda a: a.update(block_tables=a["block_tables"][0]), "block_tables"),
        (lambda a: a.update(seq_lens=a["seq_lens"][:1]), "seq_lens"),
        (lambda a: a.update(query_start_loc=a["query_start_loc"].float()), "int32 or int64"),
        (lambda a: a.update(query_start_loc=a["query_start_loc"] + 1), "query_start_loc must rise"),
        (lambda a: a.update(seq_lens=a["seq_lens"] * 0 + 1000), "blocks"),
        (lambda a: a.update(out=torch.empty(3, 4, 32)), "out must match"),
    ],
    ids="heads mixed-dtype fp64 cache-shape table-dim batch index-dtype qsl-values too-long out-shape".split(),
)
def test_bad_arguments_raise_value_error(mutate, match):
    p = make_problem(DECODE, 4, 2, 64, 8, torch.float32)
    args = dict(zip(["q", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc"], p.args()), out=None)
    mutate(args)
    with pytest.raises(ValueError, match=match):
        paged_attention_triton(**args)


def test_tile_knobs_are_validated():
    p = make_problem(DECODE, 8, 2, 64, 8, torch.float32)
    with pytest.raises(ValueError, match="tile_n"):
        paged_attention_triton(*p.args(), tile_n=24)
    with pytest.raises(ValueError, match="block_m"):
        paged_attention_triton(*p.args(), block_m=2)
    with pytest.raises(ValueError, match="split_keys"):
        paged_attention_triton(*p.args(), tile_n=32, split_keys=16)
    with pytest.raises(ValueError, match="split_keys"):
        paged_attention_triton(*p.args(), split_keys=96)
