"""The torch reference (the oracle) against SDPA and itself, and the backend dispatch of helexa.kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import helexa.kernels as kernels
from helexa.kernels import AttentionBackend, get_attention_backend, reference
from tests.support.kernels import make_problem


def _sdpa_on_contiguous(q, k, v, prefix_len, scale=None):
    """SDPA for one sequence: q (L, H, D) at positions prefix..prefix+L-1, k/v (N, KVH, D)."""
    group = q.shape[1] // k.shape[1]
    q_len, seq_len = q.shape[0], k.shape[0]
    visible = torch.arange(seq_len)[None, :] <= (prefix_len + torch.arange(q_len))[:, None]  # (L, N)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(group, 1).transpose(0, 1),
        v.repeat_interleave(group, 1).transpose(0, 1),
        attn_mask=visible,
        scale=scale,
    )  # (H, L, D)
    return out.transpose(0, 1)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_reference_matches_sdpa(num_heads, num_kv_heads, dtype):
    seqs = [(37, 1), (0, 23), (18, 9), (5, 1)]
    p = make_problem(seqs, num_heads, num_kv_heads, 64, 16, dtype, seed=num_heads)
    out = reference.paged_attention(*p.args())
    block_size = p.k_cache.shape[1]
    for b, (prefix, q_len) in enumerate(seqs):
        n = prefix + q_len
        blocks = p.block_tables[b, : -(-n // block_size)].long()
        k = p.k_cache[blocks].flatten(0, 1)[:n]  # (N, KVH, D) contiguous copy
        v = p.v_cache[blocks].flatten(0, 1)[:n]
        s, e = int(p.query_start_loc[b]), int(p.query_start_loc[b + 1])
        want = _sdpa_on_contiguous(p.q[s:e], k, v, prefix)
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(out[s:e], want, rtol=tol, atol=tol)


def test_reference_scale_and_out_buffer():
    p = make_problem([(10, 3)], 4, 2, 64, 8, torch.float64, seed=2)
    out = torch.full_like(p.q, float("nan"))
    got = reference.paged_attention(*p.args(), scale=0.05, out=out)
    assert got is out
    block_size = p.k_cache.shape[1]
    blocks = p.block_tables[0, : -(-13 // block_size)].long()
    k = p.k_cache[blocks].flatten(0, 1)[:13]
    v = p.v_cache[blocks].flatten(0, 1)[:13]
    torch.testing.assert_close(out, _sdpa_on_contiguous(p.q, k, v, 10, scale=0.05))


def test_reference_chunks_long_prefills(monkeypatch):
    """The query-chunk loop that bounds memory gives the same result as one chunk."""
    p = make_problem([(5, 40), (0, 1)], 4, 2, 64, 8, torch.float64, seed=8)
    whole = reference.paged_attention(*p.args())
    monkeypatch.setattr(reference, "_MAX_SCORE_ELEMENTS", 4 * 45 * 7)  # 7-query chunks
    torch.testing.assert_close(reference.paged_attention(*p.args()), whole, rtol=0, atol=1e-14)


def test_get_attention_backend():
    assert get_attention_backend("torch") == AttentionBackend("torch", reference.write_kv, reference.paged_attention)
    triton_backend = get_attention_backend("triton")
    assert triton_backend.paged_attention is kernels.paged_attention_triton
    assert triton_backend.write_kv is kernels.write_kv_triton
    auto = get_attention_backend("auto")
    assert auto.paged_attention is kernels.paged_attention and auto.write_kv is kernels.write_kv
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash")


def test_kernel_module_does_not_shadow_public_function():
    import helexa.kernels.attention  # noqa: F401 — loading the kernel modules (lazily imported)
    import helexa.kernels.kv_write  # noqa: F401

    assert callable(kernels.paged_attention) and kernels.paged_attention.__module__ == "helexa.kernels"
    assert kernels.write_kv.__module__ == "helexa.kernels"


@pytest.mark.parametrize("interpret,expect", [("1", "triton"), ("0", "torch")])
def test_auto_dispatch_on_cpu_follows_triton_interpret(monkeypatch, interpret, expect):
    calls = []

    def spy(name):
        def record(*args, **kwargs):
            calls.append(name)

        return record

    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    monkeypatch.setattr(kernels, "_triton_kernel", lambda name: spy("triton"))  # the lazily imported kernels
    monkeypatch.setattr(kernels.reference, "paged_attention", spy("torch"))
    monkeypatch.setattr(kernels.reference, "write_kv", spy("torch"))
    p = make_problem([(3, 1)], 4, 2, 64, 8, torch.float32)
    kernels.paged_attention(*p.args())
    kernels.write_kv(p.q[:, :2], p.q[:, :2], p.k_cache, p.v_cache, torch.tensor([0]))
    assert calls == [expect, expect]


def test_batched_decode_equals_one_sequence_at_a_time():
    """The batched decode path equals attending each sequence alone, whatever the padding holds."""
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, kvh, group, d = 40, 8, 2, 3, 32
    k_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen, dtype=torch.float64)
    lens = [1, 9, 17, 30, 64, 5]
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(lens), 8), 10_000, dtype=torch.int32)  # padding entries out of range on purpose
    used = 0
    for b, n in enumerate(lens):
        nb = -(-n // block_size)
        tables[b, :nb] = perm[used : used + nb].int()
        used += nb
    for b, n in enumerate(lens):  # poison every cache row past a sequence's end
        last = int(tables[b, (n - 1) // block_size])
        k_cache[last, (n - 1) % block_size + 1 :] = float("nan")
        v_cache[last, (n - 1) % block_size + 1 :] = float("nan")
    q = torch.randn(len(lens), kvh * group, d, generator=gen, dtype=torch.float64)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
    out = reference.paged_attention(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), qsl)
    assert torch.isfinite(out).all()
    for b, n in enumerate(lens):
        one = (tables[b : b + 1], torch.tensor([n], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32))
        alone = reference.paged_attention(q[b : b + 1], k_cache, v_cache, *one)
        torch.testing.assert_close(out[b : b + 1], alone, rtol=1e-12, atol=1e-12)


def test_batched_decode_float32_matches_the_float64_oracle():
    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size, kvh, group, d = 48, 16, 3, 3, 64
    k_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen)
    lens = [3, 40, 77, 16, 120]
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * 8].view(len(lens), 8).int()
    for b, n in enumerate(lens):  # NaN past each sequence's end, in its last block
        last = int(tables[b, (n - 1) // block_size])
        v_cache[last, (n - 1) % block_size + 1 :] = float("nan")
    q = torch.randn(len(lens), kvh * group, d, generator=gen)
    args = (tables, torch.tensor(lens, dtype=torch.int32), torch.arange(len(lens) + 1, dtype=torch.int32))
    fast = reference.paged_attention(q, k_cache, v_cache, *args)  # float32
    oracle = reference.paged_attention(q.double(), k_cache.double(), v_cache.double(), *args)
    assert torch.isfinite(fast).all()
    torch.testing.assert_close(fast.double(), oracle, rtol=1e-5, atol=1e-5)
