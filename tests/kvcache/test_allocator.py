"""BlockPool / BlockAllocator: exact ids and order, errors that change nothing, integrity checks.

Every test runs on both allocator backends: torch ops and the Triton kernels (in the interpreter).
"""

from __future__ import annotations

import pytest
import torch

from helexa.kvcache import BlockAllocator, BlockPool, OutOfBlocks
from helexa.kvcache.allocator import resolve_device

BACKENDS = ["torch", "triton"]


def _pool(backend: str, num_blocks: int = 8) -> BlockPool:
    return BlockPool(
        num_blocks, 4, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16, device="cpu", backend=backend
    )


def _snapshot(pool: BlockPool) -> tuple:
    a = pool.allocator
    return (list(a._free), list(a._refs), a.stack.clone(), a.refcount.clone(), a.top_counter.clone())


def _same(s1: tuple, s2: tuple) -> bool:
    return s1[0] == s2[0] and s1[1] == s2[1] and all(torch.equal(x, y) for x, y in zip(s1[2:], s2[2:]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_shapes_and_sizes(backend: str) -> None:
    pool = _pool(backend)
    assert pool.backend == backend
    assert pool.num_blocks == 8 and pool.block_size == 4 and pool.num_free_blocks == 8
    assert pool.bytes_per_block == 2 * 2 * 4 * 2 * 8 * 2
    caches = pool.kv_caches()
    assert len(caches) == 2
    for layer, (k, v) in enumerate(caches):
        assert k.shape == v.shape == (8, 4, 2, 8) and k.dtype == torch.float16
        assert k is pool.k_cache(layer) and v is pool.v_cache(layer)
        assert k.data_ptr() != v.data_ptr()
    with pytest.raises(ValueError, match="layer"):
        pool.k_cache(2)
    pool.check_integrity()


@pytest.mark.parametrize("backend", BACKENDS)
def test_exact_ids_and_lifo_reuse(backend: str) -> None:
    pool = _pool(backend)
    assert pool.allocate(3).tolist() == [0, 1, 2]  # block 0 is not reserved
    assert pool.allocate(2).tolist() == [3, 4]
    assert pool.num_free_blocks == 3 and pool.num_allocated_blocks == 5
    pool.free([1, 3])
    assert pool.num_free_blocks == 5
    # last freed, first reused; then the never-used blocks in order
    assert pool.allocate(4).tolist() == [3, 1, 5, 6]
    assert pool.allocate(0).tolist() == []
    assert pool.allocate(1).dtype == torch.int32
    assert pool.num_free_blocks == 0
    pool.check_integrity()


@pytest.mark.parametrize("backend", BACKENDS)
def test_refcounts(backend: str) -> None:
    pool = _pool(backend)
    ids = pool.allocate(3).tolist()  # [0, 1, 2]
    pool.incref([0, 2])
    pool.incref(torch.tensor([2]))
    assert [pool.refcount(b) for b in range(4)] == [2, 1, 3, 0]
    pool.decref(ids)  # 1 reaches zero; 0 and 2 still shared
    assert pool.num_free_blocks == 6 and [pool.refcount(b) for b in range(3)] == [1, 0, 2]
    pool.free([0])
    pool.decref([2])
    assert pool.num_free_blocks == 7
    pool.decref([2])
    assert pool.num_free_blocks == 8
    # push order is the order given: 1 first, then 0, then 2 -> popped 2, 0, 1
    assert pool.allocate(3).tolist() == [2, 0, 1]
    pool.check_integrity()
    assert pool.allocator.refcount.tolist()[:3] == [1, 1, 1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_blocks_changes_nothing(backend: str) -> None:
    pool = _pool(backend)
    pool.allocate(6)
    before = _snapshot(pool)
    assert pool.can_allocate(2) and not pool.can_allocate(3)
    with pytest.raises(OutOfBlocks) as info:
        pool.allocate(3)
    err = info.value
    assert (err.requested, err.free, err.total) == (3, 2, 8)
    assert "requested 3, free 2, total 8" in str(err)
    assert _same(before, _snapshot(pool))
    pool.check_integrity()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "op,ids,message",
    [
        ("free", [5], "never allocated"),
        ("free", [1], "double free"),
        ("free", [0, 8], "out of range"),
        ("free", [-1], "out of range"),
        ("free", [0, 2, 0], "more than once"),
        ("decref", [1], "double free"),
        ("incref", [1], "is free"),
        ("incref", [3, 3], "more than once"),
        ("incref", [9], "out of range"),
        ("free", [0.0], "must be ints"),
        ("free", torch.tensor([[0]]), "1-D integer"),
    ],
)
def test_bad_ids_raise_and_change_nothing(backend: str, op: str, ids, message: str) -> None:
    pool = _pool(backend)
    pool.allocate(4)  # 0..3
    pool.free([1])  # 1 was allocated once: freeing it again is a double free
    before = _snapshot(pool)
    with pytest.raises(ValueError, match=message):
        getattr(pool, op)(ids)
    assert _same(before, _snapshot(pool))
    pool.check_integrity()


@pytest.mark.parametrize("n", [-1, 1.0, True, "2"])
def test_bad_counts(n) -> None:
    pool = _pool("torch")
    with pytest.raises(ValueError, match="non-negative int"):
        pool.allocate(n)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"num_blocks": 0}, "num_blocks"),
        ({"block_size": -4}, "block_size"),
        ({"num_layers": 1.5}, "num_layers"),
        ({"dtype": torch.int8}, "floating-point"),
        ({"backend": "cuda"}, "backend"),
        ({"device": "meta"}, "real device"),
    ],
)
def test_bad_pool_arguments(kwargs: dict, message: str) -> None:
    args = dict(num_blocks=4, block_size=4, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, device="cpu")
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        BlockPool(**args)


def test_auto_backend_is_torch_on_cpu() -> None:
    assert BlockAllocator(4, "cpu").backend == "torch"


def test_triton_backend_needs_the_interpreter_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        BlockAllocator(4, "cpu", backend="triton")


@pytest.mark.parametrize("backend", BACKENDS)
def test_check_integrity_catches_divergence(backend: str) -> None:
    pool = _pool(backend)
    pool.allocate(3)
    pool.allocator.refcount[5] = 1  # a free block that claims a reference on the device
    with pytest.raises(RuntimeError, match="reference counts"):
        pool.check_integrity()
    pool.allocator.refcount[5] = 0
    pool.check_integrity()
    pool.allocator.stack[0] = 0  # the free stack no longer matches the mirror
    with pytest.raises(RuntimeError, match="free stack"):
        pool.check_integrity()


@pytest.mark.parametrize("backend", BACKENDS)
def test_debug_mode_checks_the_counter_every_operation(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = _pool(backend)
    pool.allocate(2)
    pool.allocator.top_counter.fill_(7)  # simulate a device counter that drifted
    with pytest.raises(RuntimeError, match="device top"):
        pool.allocate(1)
    monkeypatch.setenv("HELEXA_DEBUG", "0")
    pool.allocator.top_counter.fill_(5)  # out of debug mode nothing reads it (no sync)
    pool.allocate(1)


def test_meta_kv_device_has_shapes_but_no_storage() -> None:
    pool = BlockPool(1 << 20, 16, 32, 8, 128, torch.bfloat16, "cpu", kv_device="meta")
    assert pool.k_cache(31).is_meta and pool.k_cache(31).shape == (1 << 20, 16, 8, 128)
    assert pool.bytes_per_block == 2 * 32 * 16 * 8 * 128 * 2
    assert pool.allocate(2).tolist() == [0, 1]
    pool.check_integrity()


def test_a_cuda_device_without_an_index_resolves_to_the_current_one(monkeypatch) -> None:
    """A pool made on "cuda" compares its caches' device ("cuda:N") with its own: both must carry the index
    (the first CUDA run's integrity check failed on exactly this). Other devices pass through unchanged."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert resolve_device("cuda") == torch.device("cuda", 3) != torch.device("cuda")
    assert resolve_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("meta") == torch.device("meta")
