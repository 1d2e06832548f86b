"""KV-cache allocator benchmarks: allocate+free throughput and the per-step extend of 256 sequences.

Each helexa number is printed beside a baseline measured in the same run: a plain-Python
allocator (list free stack, dict refcounts, the same validation) and a plain-Python step builder
(lists of block ids, padded tables and slots copied into tensors). Run with
`make bench` or `pytest bench/test_bench_kvcache.py --benchmark-enable -s`.
"""

from __future__ import annotations

import pytest
import torch

from helexa.kvcache import BatchBuilder, BlockPool

NUM_BLOCKS, BLOCK_SIZE, CHUNK = 8192, 16, 256
NUM_SEQS = 256
_results: dict[str, float] = {}


class NaiveAllocator:
    """The baseline: free list and refcounts in Python, validated the same way as BlockAllocator."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks - 1, -1, -1))
        self.refs: dict[int, int] = {}

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError("out of blocks")
        out = [self.free.pop() for _ in range(n)]
        for b in out:
            self.refs[b] = 1
        return out

    def release(self, ids: list[int]) -> None:
        if len(set(ids)) != len(ids) or any(self.refs.get(b, 0) == 0 for b in ids):
            raise ValueError("bad free")
        for b in ids:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                del self.refs[b]
                self.free.append(b)


def _report(benchmark, name: str, per_call: int, unit: str, baseline: str | None = None) -> None:
    stats = getattr(benchmark, "stats", None)
    if not stats:  # --benchmark-disable: the function ran once as a test
        return
    mean = stats.stats.mean
    _results[name] = mean
    line = f"\n{name}: {mean * 1e6:.1f} us/call, {per_call / mean:,.0f} {unit}/s"
    if baseline and baseline in _results:
        line += (
            f" (baseline {baseline}: {per_call / _results[baseline]:,.0f} {unit}/s, x{_results[baseline] / mean:.2f})"
        )
    print(line)


@pytest.mark.benchmark(group="kvcache-alloc-free")
def test_alloc_free_baseline_python(benchmark) -> None:
    alloc = NaiveAllocator(NUM_BLOCKS)

    def run() -> None:
        alloc.release(alloc.allocate(CHUNK))

    benchmark(run)
    assert len(alloc.free) == NUM_BLOCKS
    _report(benchmark, "alloc+free python", 2 * CHUNK, "blocks")


@pytest.mark.benchmark(group="kvcache-alloc-free")
def test_alloc_free_blockpool_cpu(benchmark, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HELEXA_DEBUG", "0")  # debug mode reads the device counter on every call
    pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE, 1, 1, 8, torch.float16, "cpu", backend="torch")

    def run() -> None:
        pool.free(pool.allocate(CHUNK))

    benchmark(run)
    assert pool.num_free_blocks == NUM_BLOCKS
    pool.check_integrity()
    _report(benchmark, "alloc+free BlockPool(torch, cpu)", 2 * CHUNK, "blocks", "alloc+free python")


def _naive_step(tables: list[list[int]], lens: list[int], alloc: NaiveAllocator) -> tuple[torch.Tensor, ...]:
    """Baseline decode step: grow Python lists, build padded tables and slots, copy to tensors."""
    slots = []
    for ids, i in zip(tables, range(len(lens))):
        pos = lens[i]
        if pos // BLOCK_SIZE == len(ids):
            ids.extend(alloc.allocate(1))
        slots.append(ids[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        lens[i] = pos + 1
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    query_start_loc = torch.arange(len(lens) + 1, dtype=torch.int32)
    return torch.tensor(slots, dtype=torch.int64), block_tables, seq_lens, query_start_loc


@pytest.mark.benchmark(group="kvcache-extend-256")
@pytest.mark.parametrize("context", [16, 17], ids=["new-block", "no-new-block"])
def test_extend_baseline_python(benchmark, context: int) -> None:
    state: dict = {}

    def setup() -> None:
        alloc = NaiveAllocator(NUM_BLOCKS)
        tables = [alloc.allocate(-(-context // BLOCK_SIZE)) for _ in range(NUM_SEQS)]
        state.update(alloc=alloc, tables=tables, lens=[context] * NUM_SEQS)
        return (), {}

    benchmark.pedantic(lambda: _naive_step(state["tables"], state["lens"], state["alloc"]), setup=setup, rounds=50)
    _report(benchmark, f"extend-256 python {context}", NUM_SEQS, "seqs")


@pytest.mark.benchmark(group="kvcache-extend-256")
@pytest.mark.parametrize("context", [16, 17], ids=["new-block", "no-new-block"])
def test_extend_batchbuilder_cpu(benchmark, monkeypatch: pytest.MonkeyPatch, context: int) -> None:
    """One decode step of 256 sequences: with context 16 every sequence takes a new block."""
    monkeypatch.setenv("HELEXA_DEBUG", "0")
    pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE, 1, 1, 8, torch.float16, "cpu", backend="torch")
    builder = BatchBuilder(pool, max_num_seqs=NUM_SEQS, max_model_len=4096)
    state: dict = {"tables": []}

    def setup() -> None:
        for t in state["tables"]:
            pool.decref(builder.release(t))
        state["tables"] = [builder.new_table() for _ in range(NUM_SEQS)]
        builder.build([(t, context) for t in state["tables"]])
        state["batch"] = [(t, 1) for t in state["tables"]]
        return (), {}

    benchmark.pedantic(lambda: builder.build(state["batch"]), setup=setup, rounds=50)
    builder.check_integrity()
    _report(
        benchmark, f"extend-256 BatchBuilder(torch, cpu) {context}", NUM_SEQS, "seqs", f"extend-256 python {context}"
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.benchmark(group="kvcache-extend-256-cuda")
def test_extend_triton_cuda_device_time(benchmark) -> None:
    """Device time of the one-launch extend for 256 decoding sequences (target <= 10 us), no sync."""
    pool = BlockPool(NUM_BLOCKS * 4, BLOCK_SIZE, 1, 1, 8, torch.float16, "cuda", backend="triton")
    builder = BatchBuilder(pool, max_num_seqs=NUM_SEQS, max_model_len=4096)
    tables = [builder.new_table() for _ in range(NUM_SEQS)]
    builder.build([(t, BLOCK_SIZE) for t in tables])
    batch = [(t, 1) for t in tables]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: list[float] = []

    def run() -> None:
        start.record()
        builder.build(batch)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)

    benchmark.pedantic(run, rounds=100, warmup_rounds=5)
    times.sort()
    print(f"\nextend-256 triton cuda: median {times[len(times) // 2]:.1f} us between events (host+device)")
    builder.check_integrity()
