"""The reference's batched decode path equals attending each sequence alone, whatever the padding holds."""

import torch

from helexa.kernels import reference


def test_batched_decode_equals_one_sequence_at_a_time():
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
        alone = reference.paged_attention(q[b : b + 1], k_cache, v_cache, tables[b : b + 1],
                                          torch.tensor([n], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32))
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
