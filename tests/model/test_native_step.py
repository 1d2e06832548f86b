"""The fused CPU step (`helexa.model.quant.native_step`): its attention against the reference backend;
every position computed bit for bit the same however it is batched, chunked or decoded (the
batch-invariance guarantee), for every architecture and layout; against the model's own torch
layers; and which models and steps do not get it."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helexa.kernels import reference
from helexa.model.loader import load_model
from helexa.model.quant import isa, native, native_step
from helexa.model.quant.native_step import native_step_for, paged_attention
from tests.support.engines import torch_threads
from tests.support.kernel_paths import kernel_paths, use_emulated_amx, use_kernel_path
from tests.support.models import PagedCache, make_tiny_model

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernel: {native.unavailable_reason()}")


def _paged_inputs(g: torch.Generator, lens: list[int], qlens: list[int], heads: int, kv_heads: int, d: int, bs: int):
    """Random q for each sequence's last `qlens[b]` positions, its keys and values scattered over a pool
    whose unwritten slots are NaN, and the metadata: (q, k_cache, v_cache, tables, seq_lens, starts)."""
    num_blocks = sum(-(-n // bs) for n in lens) + 3
    k_cache, v_cache = (torch.full((num_blocks, bs, kv_heads, d), float("nan")) for _ in range(2))
    order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # scattered blocks; block 0 pads
    tables = torch.zeros(len(lens), max(-(-n // bs) for n in lens) + 1, dtype=torch.int32)
    for b, n in enumerate(lens):
        for i in range(-(-n // bs)):
            block = order.pop()
            tables[b, i] = block
            rows = min(bs, n - i * bs)
            k_cache[block, :rows] = torch.randn(rows, kv_heads, d, generator=g)
            v_cache[block, :rows] = torch.randn(rows, kv_heads, d, generator=g)
    starts = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(starts[-1]), heads, d, generator=g) * 2
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), starts


@pytest.mark.parametrize(
    ("heads", "kv_heads", "d", "block_size"),
    [(4, 2, 16, 4), (6, 6, 32, 8), (8, 1, 64, 16), (16, 1, 8, 4), (8, 2, 64, 16), (4, 2, 128, 16)],
)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("path", kernel_paths())
def test_paged_attention_matches_the_reference(
    heads: int, kv_heads: int, d: int, block_size: int, path: str, cache_dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode rows, whole prefills, extends after a cached prefix and short multi-row extends in one
    batch; lengths across block boundaries and across the chunks of 128 keys; GQA groups of 1 to 16, and
    tasks over several KV heads (each asking for the next head's rows while it computes one: with 2 threads,
    the 16 chunks of the split rows are enough for that) at head sizes 16 to 128; on each instruction-set path
    this CPU runs; float32 and float16 caches (read back exactly)."""
    use_kernel_path(path, monkeypatch)
    g = torch.Generator().manual_seed(heads * d)
    lens = [1, block_size, block_size + 1, 37, 128, 129, 300, 260, 140, 1100, 1030]
    qlens = [1, block_size, 1, 37, 1, 2, 40, 260, 9, 1, 3]  # decode, prefill, split extend (<= 8 rows), tiled
    q, k_cache, v_cache, tables, seq_lens, starts = _paged_inputs(g, lens, qlens, heads, kv_heads, d, block_size)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    want = reference.paged_attention(q.double(), k_cache.double(), v_cache.double(), tables, seq_lens, starts)
    with torch_threads(2):
        got = paged_attention(q, k_cache, v_cache, tables, seq_lens, starts)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "d"), [(1, 1, 64), (2, 1, 64), (3, 1, 64), (8, 2, 64), (9, 3, 64), (5, 1, 128), (4, 2, 40)]
)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=str)
def test_attention_is_the_same_bits_on_every_path(
    heads: int, kv_heads: int, d: int, cache_dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Query heads of a KV head share each K and V row's widening (csrc/step.c: scores_grouped4 and
    values_grouped4, scores_pair and values_pair): 4 at a time with AVX-512 where D is 64, else 2 where D
    is a multiple of 32 (so `avx2` and `avx512_vnni` group D 64 differently); a last head alone, and
    another D, go one head at a time. Every way does each element's arithmetic alike, so every path gives
    the same bits: 1 to 9 heads per KV head, D 64, 128 (several slices of values) and one no group takes,
    key counts that end inside a group of 8 keys and inside a chunk. Needs two paths this CPU runs."""
    runnable = [p for p in kernel_paths() if not isa.missing(isa.PATHS[p])]
    if len(runnable) < 2:
        pytest.skip(f"this CPU runs only {runnable} of the kernel paths {kernel_paths()}: nothing to compare")
    g = torch.Generator().manual_seed(heads * d + kv_heads)
    lens = [1, 7, 8, 13, 130, 300]
    qlens = [1, 7, 1, 13, 3, 20]  # decode, a whole prefill, split extends (<= 8 rows), a tile of rows
    q, k_cache, v_cache, tables, seq_lens, starts = _paged_inputs(g, lens, qlens, heads, kv_heads, d, 16)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    got = {}
    for path in runnable:
        use_kernel_path(path, monkeypatch)
        got[path] = paged_attention(q, k_cache, v_cache, tables, seq_lens, starts)
    assert not got[runnable[0]].isnan().any()
    first, *others = runnable
    for path in others:
        assert torch.equal(got[path], got[first]), path


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 300)), min_size=1, max_size=6),
    probe=st.integers(0, 10**6),
)
def test_a_query_attends_the_same_bits_whatever_shares_the_call(seqs: list[tuple[int, int]], probe: int) -> None:
    """Any batch of sequences, each with any number of query rows: every row equals the same position
    computed alone as a decode row and inside its own sequence alone, bit for bit."""
    g = torch.Generator().manual_seed(probe)
    lens = [max(n, q) for n, q in seqs]
    qlens = [q for _, q in seqs]
    q, k_cache, v_cache, tables, seq_lens, starts = _paged_inputs(g, lens, qlens, 6, 2, 16, 8)
    batch = paged_attention(q, k_cache, v_cache, tables, seq_lens, starts)
    b = probe % len(lens)
    s, e = int(starts[b]), int(starts[b + 1])
    own = torch.tensor([0, e - s], dtype=torch.int32)
    alone = paged_attention(q[s:e], k_cache, v_cache, tables[b : b + 1], seq_lens[b : b + 1], own)
    assert torch.equal(alone, batch[s:e])
    i = probe % (e - s)  # one row, as a decode of its position
    one = paged_attention(
        q[s + i : s + i + 1], k_cache, v_cache, tables[b : b + 1],
        torch.tensor([lens[b] - qlens[b] + i + 1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
    )  # fmt: skip
    assert torch.equal(one, batch[s + i : s + i + 1])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=str)
def test_long_context_decode_rows_are_the_same_bits_whatever_the_task_grouping(cache_dtype) -> None:
    """A decode row over 9 chunks of keys: with 1 thread its chunk tasks cover every KV head (enough
    chunks per thread), with 8 threads one KV head each; the same bits either way, and the reference's
    values. A mutation that folds a chunk twice or skips a KV head in the grouped tasks fails this."""
    g = torch.Generator().manual_seed(11)
    lens, qlens = [1100, 1030], [1, 3]
    q, k_cache, v_cache, tables, seq_lens, starts = _paged_inputs(g, lens, qlens, 8, 4, 16, 16)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    got = {}
    with torch_threads(1):
        got[1] = paged_attention(q, k_cache, v_cache, tables, seq_lens, starts)
    with torch_threads(8):
        got[8] = paged_attention(q, k_cache, v_cache, tables, seq_lens, starts)
    assert torch.equal(got[1], got[8])
    want = reference.paged_attention(q.double(), k_cache.double(), v_cache.double(), tables, seq_lens, starts)
    torch.testing.assert_close(got[1], want.float(), rtol=1e-5, atol=1e-5)


def test_calls_from_several_threads_keep_their_own_buffers() -> None:
    """The C step keeps each calling thread's working buffers between its calls (grown, never shared):
    threads calling at once, each over inputs of a different size, every call poisoning its buffers for the
    next, get the bits each gets alone."""
    import threading

    cases = []
    for i in range(4):
        g = torch.Generator().manual_seed(i)
        lens = [300 + 150 * i, 7, 129 + i][: 2 + i % 2]
        inputs = _paged_inputs(g, lens, [1, 7, 3][: len(lens)], 8, 2, 64, 16)
        cases.append((inputs, paged_attention(*inputs)))
    failures: list[str] = []

    def run(i: int) -> None:
        inputs, want = cases[i]
        for _ in range(15):
            if not torch.equal(paged_attention(*inputs), want):
                failures.append(f"thread {i}")
                return
            paged_attention(*cases[(i + 1) % 4][0])  # another size in between, in the same thread

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not failures and not any(t.is_alive() for t in threads)


def test_paged_attention_checks_its_inputs() -> None:
    q, cache = torch.randn(1, 2, 12), torch.randn(4, 4, 2, 12)  # D = 12: not a multiple of 8
    tables, lens, starts = torch.ones(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="D % 8"):
        paged_attention(q, cache, cache, tables, lens, starts.int())
    q, cache = torch.randn(1, 2, 16), torch.randn(4, 4, 2, 16)
    with pytest.raises(ValueError, match="int32"):
        paged_attention(q, cache, cache, tables.long(), lens, starts.int())
    with pytest.raises(ValueError, match="ending at 1"):
        paged_attention(q, cache, cache, tables, lens, torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="more blocks than its table holds"):  # 5 tokens, one block of 4
        paged_attention(q, cache, cache, tables, lens * 5, starts.int())
    with pytest.raises(ValueError, match="more query rows than its length"):  # 2 rows of a 1-token sequence
        paged_attention(torch.randn(2, 2, 16), cache, cache, tables, lens, torch.tensor([0, 2], dtype=torch.int32))


# ----------------------------------------------------------------------------------- the model


@pytest.fixture(scope="module", params=[("llama", "int4"), ("qwen2", "int8"), ("qwen3", "int4")], ids=str)
def quantized(request, tmp_path_factory):
    """A tiny quantized model with the fused step: plain Llama, Qwen2 (q|k|v bias), Qwen3 (q/k norms; as
    Qwen3's models, its heads are wider than the hidden size: 4 x 32 over 64, so the step's buffers that hold
    a row's attention and its hidden state in turn are sized for the wider)."""
    arch, method = request.param
    wide = {"head_dim": 32} if arch == "qwen3" else {}
    path = make_tiny_model(tmp_path_factory.mktemp(arch), arch, intermediate_size=128, num_hidden_layers=2, **wide)
    model = load_model(path, dtype="float32", attention_backend="torch", quantization=method)
    assert model.native_step is not None
    return model


def _schedule_run(
    model, prompts: dict[int, list[int]], schedule: list[dict[int, int]], dtype: torch.dtype = torch.float32
):
    """Run `schedule` (per step: sequence -> how many of its next tokens) and return the logits of every
    position, {(seq, pos): (V,)}, and the cache (of `dtype`) to read K/V from."""
    cache = PagedCache(model.config, num_blocks=160, block_size=8, dtype=dtype)
    done = {s: 0 for s in prompts}
    logits: dict[tuple[int, int], torch.Tensor] = {}
    for step in schedule:
        tokens = {s: prompts[s][done[s] : done[s] + n] for s, n in step.items()}
        inputs = cache.step(tokens, all_logits=True)
        out = model(inputs.input_ids, inputs.positions, inputs.attn, cache.kv_caches, inputs.logits_indices)
        for row, owner in enumerate(inputs.row_owner):
            logits[owner] = out[row]
        for s, n in step.items():
            done[s] += n
    return logits, cache


def _kv(cache: PagedCache, seq: int, pos: int) -> list[torch.Tensor]:
    block = cache.seqs[seq].blocks[pos // cache.block_size]
    return [t[block, pos % cache.block_size] for pair in cache.kv_caches for t in pair]


def _random_schedule(rng: random.Random, lengths: dict[int, int]) -> list[dict[int, int]]:
    """Steps that mix any sequences, each taking a random chunk (1 token: a decode row) of what it has left."""
    left, steps = dict(lengths), []
    while any(left.values()):
        live = [s for s, n in left.items() if n]
        step = {
            s: min(left[s], rng.choice([1, 1, 2, 5, rng.randint(1, 200)]))
            for s in rng.sample(live, rng.randint(1, len(live)))
        }
        for s, n in step.items():
            left[s] -= n
        steps.append(step)
    return steps


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(seed=st.integers(0, 2**31 - 1))
def test_every_position_is_computed_the_same_however_it_is_scheduled(quantized, seed: int) -> None:
    """Logits of every position and the K/V written for it, bit for bit, whether the sequence ran alone
    as one prefill, token by token beside the others, or in random chunks mixed with other sequences
    (decode rows, split extends, long prefill chunks in one step; contexts across the 128-key chunks)."""
    _check_schedules(quantized, random.Random(seed))


def _check_schedules(quantized, rng: random.Random, dtype: torch.dtype = torch.float32) -> None:
    """Random prompts run alone as one prefill each, then in a random chunked mix and token by token,
    over caches of `dtype`: every position's logits and K/V equal, bit for bit."""
    vocab = quantized.config.vocab_size
    prompts = {s: [rng.randrange(vocab) for _ in range(rng.randint(1, 260))] for s in range(rng.randint(2, 4))}
    lengths = {s: len(p) for s, p in prompts.items()}
    alone = {}
    for s in prompts:  # the reference: each sequence by itself, its whole text in one step
        logits, cache = _schedule_run(quantized, {s: prompts[s]}, [{s: lengths[s]}], dtype)
        alone.update({key: (row, _kv(cache, *key)) for key, row in logits.items()})
    for schedule in (_random_schedule(rng, lengths), [dict.fromkeys(prompts, 1)] * max(lengths.values())):
        schedule = [{s: n for s, n in step.items() if n} for step in _trim(schedule, lengths)]
        logits, cache = _schedule_run(quantized, prompts, schedule, dtype)
        assert logits.keys() == alone.keys()
        for key, row in logits.items():
            want_row, want_kv = alone[key]
            assert torch.equal(row, want_row), f"logits of {key} differ: max {float((row - want_row).abs().max())}"
            assert all(torch.equal(a, b) for a, b in zip(_kv(cache, *key), want_kv)), f"K/V of {key} differ"


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("path", kernel_paths())
def test_each_kernel_path_computes_every_position_the_same_however_it_is_scheduled(
    quantized, path: str, cache_dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch-invariance guarantee holds within each instruction-set path this CPU runs, over float32
    and float16 caches (the test above explores schedules on the default path and a float32 cache;
    this one runs one fixed mix on every path and cache dtype)."""
    use_kernel_path(path, monkeypatch)
    _check_schedules(quantized, random.Random(7), cache_dtype)


def test_the_amx_tiling_computes_every_position_as_avx512_vnni_does(quantized, monkeypatch: pytest.MonkeyPatch) -> None:
    """The `avx512_amx` path's source with its tile operations emulated (tests.support.kernel_paths): every
    position's logits and K/V are the same bits however the sequences are scheduled (prefill chunks of 16
    rows and more go through the tiles), and the same bits as on `avx512_vnni`."""
    rng = random.Random(11)
    vocab = quantized.config.vocab_size
    prompts = {s: [rng.randrange(vocab) for _ in range(n)] for s, n in enumerate((70, 23, 5))}
    schedule = [{0: 40, 1: 1}, {0: 30, 1: 22, 2: 5}]
    use_kernel_path("avx512_vnni", monkeypatch)
    want, want_cache = _schedule_run(quantized, prompts, schedule)
    lib = use_emulated_amx(monkeypatch)
    before = lib.helexa_amx_emulated_products()
    got, got_cache = _schedule_run(quantized, prompts, schedule)
    assert lib.helexa_amx_emulated_products() > before
    assert got.keys() == want.keys()
    for key, row in got.items():
        assert torch.equal(row, want[key]), f"logits of {key} differ"
        assert all(torch.equal(a, b) for a, b in zip(_kv(got_cache, *key), _kv(want_cache, *key))), f"K/V of {key}"
    _check_schedules(quantized, random.Random(7))


def test_a_step_longer_than_the_mlps_row_chunk_computes_every_row_alike(
    quantized, monkeypatch: pytest.MonkeyPatch
) -> None:
    """step.c runs the MLP 64 rows at a time: a 600-token prompt in one native call (ten MLP chunks,
    the last one short; `STEP_ROWS` raised so the step is not cut into calls first), in steps of 100
    and in one mixed step beside another sequence give the same logits and K/V, bit for bit."""
    monkeypatch.setattr(native_step, "STEP_ROWS", 10**9)
    rng = random.Random(3)
    vocab = quantized.config.vocab_size
    prompts = {0: [rng.randrange(vocab) for _ in range(600)], 1: [rng.randrange(vocab) for _ in range(37)]}
    one, one_cache = _schedule_run(quantized, {0: prompts[0]}, [{0: 600}])
    chunks, chunks_cache = _schedule_run(quantized, {0: prompts[0]}, [{0: 100}] * 6)
    mixed, mixed_cache = _schedule_run(quantized, prompts, [{1: 37, 0: 300}, {0: 300}])
    for pos in range(600):
        key = (0, pos)
        assert torch.equal(one[key], chunks[key]) and torch.equal(one[key], mixed[key]), f"logits of {key}"
        want = _kv(one_cache, *key)
        assert all(torch.equal(a, b) for a, b in zip(want, _kv(chunks_cache, *key))), f"K/V of {key}"
        assert all(torch.equal(a, b) for a, b in zip(want, _kv(mixed_cache, *key))), f"K/V of {key}"


def _team_schedule(rows: int, vocab: int) -> tuple[dict[int, list[int]], list[dict[int, int]]]:
    """Prompts of 4 sequences (contexts across the 128-key chunks) and a schedule that prefills them, then runs
    steps of fewer than 8 rows (the fused step's team, csrc/step.c's decoder_team) totalling `rows` rows each:
    decode rows of several sequences, or a few tokens of one (as drafts are verified)."""
    rng = random.Random(rows)
    prompts = {s: [rng.randrange(vocab) for _ in range(n)] for s, n in enumerate((140, 9, 127, 60))}
    prefill = {0: 130, 1: 2, 2: 120, 3: 50}
    steps = [prefill]
    done = dict(prefill)
    for _ in range(3):
        step, left = {}, rows
        for s in rng.sample(sorted(prompts), len(prompts)):
            n = min(left, len(prompts[s]) - done[s], rng.randint(1, rows))
            if n > 0:
                step[s], left = n, left - n
                done[s] += n
        steps.append(step)
    return prompts, steps


@pytest.mark.parametrize("rows", [1, 3, 7])
def test_a_step_of_few_rows_is_the_same_bits_on_one_thread_and_on_a_team(quantized, rows: int) -> None:
    """A step of fewer than 8 rows runs in one parallel region when there are threads to share it (each thread
    computing the per-row work itself, barriers where results are shared); on one thread it runs as every other
    step does. Logits and K/V of every position, bit for bit, on 1, 2 and 3 threads (with a q|k|v bias, q/k
    norms and wide heads through the fixture's architectures)."""
    prompts, schedule = _team_schedule(rows, quantized.config.vocab_size)
    assert all(0 < sum(step.values()) < 8 for step in schedule[1:])
    got = {}
    for threads in (1, 2, 3):
        with torch_threads(threads):
            got[threads] = _schedule_run(quantized, prompts, schedule)
    (want, want_cache) = got[1]
    for threads in (2, 3):
        logits, cache = got[threads]
        assert logits.keys() == want.keys()
        for key, row in want.items():
            assert torch.equal(logits[key], row), f"logits of {key} on {threads} threads"
            assert all(torch.equal(a, b) for a, b in zip(_kv(cache, *key), _kv(want_cache, *key))), f"K/V of {key}"


_TEAM_OF_ONE = """
import sys, tempfile, torch
from pathlib import Path
from helexa.model.loader import load_model
from tests.model.test_native_step import _schedule_run, _team_schedule
from tests.support.models import make_tiny_model
path = make_tiny_model(Path(tempfile.mkdtemp()), "qwen2", intermediate_size=128, num_hidden_layers=2)
model = load_model(path, dtype="float32", attention_backend="torch", quantization="int4")
prompts, schedule = _team_schedule(3, model.config.vocab_size)
torch.set_num_threads(1)
want, _ = _schedule_run(model, prompts, schedule)
torch.set_num_threads(3)  # a team asked for 3 threads, given 1 (OMP_THREAD_LIMIT=1)
got, _ = _schedule_run(model, prompts, schedule)
sys.exit(0 if all(torch.equal(got[k], want[k]) for k in want) else "a smaller team computed other logits")
"""


def test_a_team_smaller_than_the_threads_asked_for_computes_the_same_step() -> None:
    """OpenMP may give the step's region fewer threads than it asked for (OMP_THREAD_LIMIT): the projections'
    tiles are shared out among the threads it got, and the logits are those of one thread."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_THREAD_LIMIT": "1"}
    done = subprocess.run([sys.executable, "-c", _TEAM_OF_ONE], capture_output=True, text=True, timeout=300,
                          cwd=root, env=env)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_a_step_run_in_pieces_computes_every_row_alike(quantized, rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of more than `STEP_ROWS` rows runs as consecutive native calls, each embedding its own rows
    when it comes; pieces that cut sequences anywhere (mid-prefill, between decode rows, one row each) give
    the logits and K/V of the step run in one call, bit for bit."""
    rng = random.Random(rows)
    vocab = quantized.config.vocab_size
    prompts = {s: [rng.randrange(vocab) for _ in range(n)] for s, n in enumerate((150, 3, 90, 41))}
    schedule = [{0: 100, 1: 1, 2: 60}, {1: 1, 3: 41, 0: 50, 2: 30}, {1: 1, 0: 0, 2: 0}]
    schedule = [{s: n for s, n in step.items() if n} for step in schedule]
    monkeypatch.setattr(native_step, "STEP_ROWS", 10**9)
    whole, whole_cache = _schedule_run(quantized, prompts, schedule)
    monkeypatch.setattr(native_step, "STEP_ROWS", rows)
    looked_up = _count_rows_per_call(monkeypatch)  # each native call's rows (it embeds them): a piece's
    pieces, pieces_cache = _schedule_run(quantized, prompts, schedule)
    assert looked_up and max(looked_up) == rows and sum(looked_up) == sum(sum(step.values()) for step in schedule)
    assert pieces.keys() == whole.keys()
    for key, row in whole.items():
        assert torch.equal(pieces[key], row), f"logits of {key} differ: max {float((pieces[key] - row).abs().max())}"
        assert all(torch.equal(a, b) for a, b in zip(_kv(pieces_cache, *key), _kv(whole_cache, *key))), f"K/V {key}"


def _count_rows_per_call(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the rows of each native forward call from now on (the list returned fills as they run)."""
    rows: list[int] = []
    lib = native.library()

    class Counting:
        def __getattr__(self, name: str):
            return getattr(lib, name)

        def helexa_forward(self, model, t, *rest):
            rows.append(t)
            return lib.helexa_forward(model, t, *rest)

    counting = Counting()
    real = native.library
    monkeypatch.setattr(native, "library", lambda: (real(), counting)[1])
    return rows


def _trim(schedule: list[dict[int, int]], lengths: dict[int, int]) -> list[dict[int, int]]:
    """Cut a token-by-token schedule at each sequence's length."""
    done = dict.fromkeys(lengths, 0)
    out = []
    for step in schedule:
        kept = {s: min(n, lengths[s] - done[s]) for s, n in step.items()}
        for s, n in kept.items():
            done[s] += n
        out.append(kept)
    return [step for step in out if any(step.values())]


@pytest.mark.parametrize(
    ("path", "cache_dtype"),
    [*((p, torch.float32) for p in kernel_paths()), (kernel_paths()[-1], torch.float16)],
    ids=str,
)
def test_the_fused_step_matches_the_layers(quantized, path: str, cache_dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C step computes what the torch layers compute (the oracle): a prefill batch, then decode
    steps, each run both ways from the same cache. Both round each projection's input to int8 per
    block of 32, and their norms, RoPE and softmax round differently in the last float32 bit: now and
    then a value lands on the other side of an int8 rounding boundary. So most rows must agree to
    float32 precision, and every row within 2% of the logits' scale; the K/V written likewise, and
    nothing else in the pool may change. On each instruction-set path this CPU runs; with a float16
    cache too (the layers write it through the reference's rounding, the same as the step's)."""
    use_kernel_path(path, monkeypatch)
    model = quantized
    prompts = {0: [5, 9, 17, 3, 44, 8, 21], 1: [60, 2], 2: list(range(11, 150))}
    fused, layers = (PagedCache(model.config, num_blocks=64, block_size=4, dtype=cache_dtype) for _ in range(2))
    g = torch.Generator().manual_seed(1)
    exact_rows = rows = 0
    steps = [prompts] + [{i: [int(torch.randint(0, 320, (1,), generator=g))] for i in prompts} for _ in range(6)]
    for tokens in steps:
        for (fk, fv), (lk, lv) in zip(fused.kv_caches, layers.kv_caches):
            fk.copy_(lk)
            fv.copy_(lv)
        want, _ = _run(model, layers, tokens, fused=False)
        got, took = _run(model, fused, tokens, fused=True)
        assert took
        scale = float(want.abs().max())
        torch.testing.assert_close(got, want, rtol=0, atol=0.02 * scale)
        exact_rows += int(((got - want).abs().amax(dim=1) <= 1e-5 * scale).sum())
        rows += want.shape[0]
        written = torch.zeros(64, 4, dtype=torch.bool)  # this step's slots
        for seq_id, seq in fused.seqs.items():
            for pos in range(len(seq.tokens) - len(tokens[seq_id]), len(seq.tokens)):
                written[seq.blocks[pos // 4], pos % 4] = True
        for (fk, fv), (lk, lv) in zip(fused.kv_caches, layers.kv_caches):
            for f, ref in ((fk, lk), (fv, lv)):
                assert torch.equal(f[~written], ref[~written])  # nothing else in the pool changes
                torch.testing.assert_close(f[written], ref[written], rtol=0, atol=0.02 * float(ref.abs().max()))
    assert exact_rows >= rows * 2 // 3, f"only {exact_rows} of {rows} rows agree to float32 precision"


def _run(model, cache: PagedCache, tokens: dict[int, list[int]], fused: bool) -> tuple[torch.Tensor, bool]:
    """(logits of every new token, whether the fused step computed them) of one step; `fused=False`
    forces the layers."""
    step = cache.step(tokens, all_logits=True)
    saved, results = model.native_step, []
    model.native_step = (lambda *args: results.append(saved(*args)) or results[-1]) if fused else None
    try:
        logits = model(step.input_ids, step.positions, step.attn, cache.kv_caches, step.logits_indices)
    finally:
        model.native_step = saved
    return logits, any(r is not None for r in results)


def test_models_and_steps_the_fused_step_does_not_take(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = make_tiny_model(tmp_path, "llama", intermediate_size=128)
    dense = load_model(path, dtype="float32", attention_backend="torch")
    assert dense.native_step is None
    assert "o_proj" in native_step_for(dense)[1]
    bf16 = load_model(path, dtype="bfloat16", attention_backend="torch", quantization="int8")
    assert bf16.native_step is None and "float32" in native_step_for(bf16)[1]
    model = load_model(path, dtype="float32", attention_backend="torch", quantization="int8")
    fused = model.native_step
    assert fused is not None
    cache = PagedCache(model.config, num_blocks=8, block_size=4)
    before = [t.clone() for pair in cache.kv_caches for t in pair]
    step = cache.step({0: [1, 2, 3]})
    hidden = torch.randn(3, model.config.hidden_size)
    bf16_caches = [(k.bfloat16(), v.bfloat16()) for k, v in cache.kv_caches]  # caches it cannot read (as fp8's)
    assert fused(hidden, step.positions, step.attn, bf16_caches, step.logits_indices) is None
    assert (
        fused(hidden[:2], step.positions[:2], step.attn, cache.kv_caches, step.logits_indices) is None
    )  # rows != slots
    assert all(torch.equal(a, b) for a, b in zip(before, [t for pair in cache.kv_caches for t in pair]))
    monkeypatch.setenv("HELEXA_CPU_STEP", "torch")
    assert native_step_for(model) == (None, "HELEXA_CPU_STEP=torch")


def test_the_library_runs_on_torchs_thread_count() -> None:
    """The kernels take torch's intra-op thread count at each call, whichever thread calls (an engine
    thread gets OpenMP's default otherwise) and however often it changes."""
    import threading

    lib = native.library()
    before = torch.get_num_threads()
    seen: list[int] = []
    try:
        for n in (1, 2, 1):
            torch.set_num_threads(n)
            native.library()
            seen.append(lib.helexa_threads())
        worker = threading.Thread(target=lambda: (native.library(), seen.append(lib.helexa_threads())))
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 2, 1, 1]


def test_the_step_embeds_and_samples_in_c_as_python_would(quantized, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused step looks the tokens up in the embedding table itself; with the lookup left to Python (as
    for a table the C side cannot read, here the model's own embedding module returning views of a table)
    every position's logits and K/V are the same bits, and the embeddings it was given are never written."""
    rng = random.Random(5)
    vocab, hidden = quantized.config.vocab_size, quantized.config.hidden_size
    prompts = {s: [rng.randrange(vocab) for _ in range(n)] for s, n in enumerate((31, 6, 19))}
    schedule = [{0: 20, 1: 4}, {0: 10, 1: 1, 2: 17}, {0: 1, 1: 1, 2: 1}, {2: 1}]
    want, want_cache = _schedule_run(quantized, prompts, schedule)
    table = quantized.model.embed_tokens(torch.arange(vocab))  # (V, E) float32: the lookup's own rows
    saved = table.clone()
    views: list[torch.Tensor] = []

    def lookup(ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[0] == 1:  # one row: a view into the table itself, which the step must leave alone
            views.append(table[int(ids[0]) : int(ids[0]) + 1])
            return views[-1]
        return table[ids]

    step, why = native_step_for(quantized)  # a step of its own, whose table the C side is told nothing of
    assert step is not None, why
    step._embed, step._model.embed = lookup, native_step._Table()
    monkeypatch.setattr(quantized, "native_step", step)
    got, got_cache = _schedule_run(quantized, prompts, schedule)
    assert views and torch.equal(table, saved) and table.shape == (vocab, hidden)
    assert got.keys() == want.keys()
    for key, row in want.items():
        assert torch.equal(got[key], row), f"logits of {key} differ"
        assert all(torch.equal(a, b) for a, b in zip(_kv(got_cache, *key), _kv(want_cache, *key))), f"K/V of {key}"


@pytest.mark.parametrize("tie", [False, True], ids=["own head", "tied"])
def test_a_gguf_models_lookup_and_head_in_c_are_its_modules_bits(tmp_path: Path, tie: bool) -> None:
    """A GGUF model's embedding and head are tiled quantized tables (tied: one table), read by the C call
    itself: its lookup gives the `QuantEmbedding`'s rows bit for bit (every position's logits and K/V the
    same with the lookup left to Python), and its head gives the `QuantLinear` head's logits of the same
    final-normed rows bit for bit (read out through an identity head, whose dot products are exact)."""
    from helexa.model.quant import QuantEmbedding
    from helexa.model.weights.gguf import convert_gguf
    from tests.support.gguf import Q, write_tiny_gguf

    path, _ = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", Q.Q4_1, tie=tie)
    model = load_model(convert_gguf(path, tmp_path / "hf", progress=False), dtype="float32", attention_backend="torch")
    step = model.native_step
    assert isinstance(model.model.embed_tokens, QuantEmbedding) and step is not None
    assert step._model.embed.q.weight and step._model.head.q.weight  # both tables are the kernel's tiles
    rng = random.Random(1)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    prompts = {s: [rng.randrange(vocab) for _ in range(n)] for s, n in enumerate((23, 6))}
    schedule = [{0: 20, 1: 5}, {0: 3, 1: 1}]
    want, want_cache = _schedule_run(model, prompts, schedule)
    python_lookup, why = native_step_for(model)
    assert python_lookup is not None, why
    python_lookup._embed, python_lookup._model.embed = model.model.embed_tokens, native_step._Table()
    model.native_step = python_lookup
    try:
        got, got_cache = _schedule_run(model, prompts, schedule)
    finally:
        model.native_step = step
    for key, row in want.items():
        assert torch.equal(got[key], row), f"logits of {key} differ"
        assert all(torch.equal(a, b) for a, b in zip(_kv(got_cache, *key), _kv(want_cache, *key))), f"K/V of {key}"
    # The head: the same step through an identity head gives the final-normed rows themselves.
    rows_out, why = native_step_for(model)
    assert rows_out is not None, why
    identity = torch.eye(hidden)
    rows_out._keep.append(identity)
    rows_out._model.head = native_step._Table(native_step._Linear(), identity.data_ptr(), hidden)
    rows_out._vocab = hidden
    cache = PagedCache(model.config, num_blocks=16, block_size=4)
    inputs = cache.step(prompts, all_logits=True)
    pool = [t.clone() for pair in cache.kv_caches for t in pair]
    out = step(inputs.input_ids, inputs.positions, inputs.attn, cache.kv_caches, inputs.logits_indices)
    for t, saved in zip([t for pair in cache.kv_caches for t in pair], pool):
        t.copy_(saved)
    normed_out = rows_out(inputs.input_ids, inputs.positions, inputs.attn, cache.kv_caches, inputs.logits_indices)
    assert out is not None and normed_out is not None
    logits, normed = out[0], normed_out[0]
    assert normed.shape == (logits.shape[0], hidden)
    head = model.model.embed_tokens.head if tie else model.lm_head
    assert torch.equal(logits, head(normed))


def test_the_sampled_rows_come_back_in_the_order_asked(quantized) -> None:
    """`logits_indices` may name the step's rows in any order, and a row more than once: each logits row is
    that step row's, bit for bit; a row outside the step is an error that writes nothing to the pool."""
    cache = PagedCache(quantized.config, num_blocks=16, block_size=4)
    step = cache.step({0: [5, 9, 17, 3, 44], 1: [60, 2]}, all_logits=True)
    before = [t.clone() for pair in cache.kv_caches for t in pair]
    every = quantized(step.input_ids, step.positions, step.attn, cache.kv_caches, step.logits_indices)
    for k, v in cache.kv_caches:  # the same step again from the same pool
        k.copy_(before.pop(0))
        v.copy_(before.pop(0))
    order = torch.tensor([6, 0, 3, 3, 1])
    picked = quantized(step.input_ids, step.positions, step.attn, cache.kv_caches, order)
    assert picked.shape == (5, every.shape[1])
    for i, row in enumerate(order.tolist()):
        assert torch.equal(picked[i], every[row])
    pool = [t.clone() for pair in cache.kv_caches for t in pair]
    with pytest.raises(ValueError, match="outside the step"):
        quantized.native_step(step.input_ids, step.positions, step.attn, cache.kv_caches, torch.tensor([7]))
    assert all(torch.equal(a, b) for a, b in zip(pool, [t for pair in cache.kv_caches for t in pair]))


def test_a_token_outside_the_vocabulary_is_an_index_error(quantized) -> None:
    """A token id outside the embedding table fails the step with the id named, before anything is
    written to the pool."""
    cache = PagedCache(quantized.config, num_blocks=8, block_size=4)
    vocab = quantized.config.vocab_size
    step = cache.step({0: [1, vocab + 3, 2]})
    pool = [t.clone() for pair in cache.kv_caches for t in pair]
    with pytest.raises(IndexError, match=f"token id {vocab + 3} is out of range"):
        quantized.native_step(step.input_ids, step.positions, step.attn, cache.kv_caches, step.logits_indices)
    assert all(torch.equal(a, b) for a, b in zip(pool, [t for pair in cache.kv_caches for t in pair]))


def test_logits_the_caller_is_done_with_reuse_one_buffer(quantized, monkeypatch: pytest.MonkeyPatch) -> None:
    """With `reuse_logits` the step's logits are rows of one buffer the step keeps (grown when a step has more
    rows, never past `REUSED_LOGITS_BYTES`), the same bits as logits of their own; without it, and past the
    cap, each call's logits are their own."""
    cache = PagedCache(quantized.config, num_blocks=16, block_size=4)
    step = cache.step({0: [5, 9, 17, 3, 44], 1: [60, 2]}, all_logits=True)
    pool = [t.clone() for pair in cache.kv_caches for t in pair]

    def run(rows: list[int], reuse: bool) -> torch.Tensor:
        for t, saved in zip([t for pair in cache.kv_caches for t in pair], pool):  # the same step each time
            t.copy_(saved)
        return quantized(step.input_ids, step.positions, step.attn, cache.kv_caches, torch.tensor(rows), reuse)

    own = run([6, 1], False)
    first = run([6, 1], True)
    assert torch.equal(first, own) and first.data_ptr() != own.data_ptr()
    kept = first.clone()
    again = run([6], True)  # fewer rows: the same buffer, overwritten
    assert again.data_ptr() == first.data_ptr() and torch.equal(again[0], kept[0])
    grown = run([0, 1, 2, 3, 4, 5, 6], True)  # more rows: a larger buffer
    assert grown.shape[0] == 7 and torch.equal(grown[[6, 1]], own)
    assert run([2], False).data_ptr() != grown.data_ptr()
    monkeypatch.setattr(native_step, "REUSED_LOGITS_BYTES", 4 * grown.shape[1])  # one row at most
    assert run([6], True).data_ptr() == grown.data_ptr()
    over = [run([6, 1], True), run([6, 1], True)]  # two rows: past the cap, each its own
    assert len({grown.data_ptr(), *(t.data_ptr() for t in over)}) == 3 and torch.equal(over[0], own)


def _gguf_model(tmp_path: Path, qtype_name: str, tie: bool):
    from helexa.model.weights.gguf import convert_gguf
    from tests.support.gguf import Q, write_tiny_gguf

    path, _ = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", getattr(Q, qtype_name), tie=tie)
    return load_model(convert_gguf(path, tmp_path / "hf", progress=False), dtype="float32", attention_backend="torch")


def _rerun(cache: PagedCache):
    """A function that puts the pool back as it is now: the same step can then run again from it."""
    saved = [t.clone() for pair in cache.kv_caches for t in pair]

    def restore() -> None:
        for t, s in zip([t for pair in cache.kv_caches for t in pair], saved):
            t.copy_(s)

    return restore


@pytest.mark.parametrize(("qtype", "tie"), [("Q4_1", True), ("Q8_0", False)], ids=["q4_1 tied", "q8_0 own head"])
def test_argmax_rows_take_the_argmax_of_their_logits_a_block_at_a_time(
    tmp_path: Path, qtype: str, tie: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows asked for only their argmax (`argmax_indices`) get the index torch's argmax gives of their logits
    over the first `argmax_cols` columns, whatever block of the quantized head the C side folds at a time (one
    tile of 16 columns, three, a size off the tiles, the whole head), in any order, with or without logits rows
    beside them, and in a step run in pieces; the logits rows stay the same bits, and so does the pool."""
    model = _gguf_model(tmp_path, qtype, tie)
    step = model.native_step
    assert step is not None and step._model.head.q.weight  # the head is the kernel's tiled table
    vocab = model.config.vocab_size
    cache = PagedCache(model.config, num_blocks=16, block_size=4)
    inputs = cache.step({0: [5, 9, 17, 3, 44], 1: [60, 2], 2: [7, 7, 1, 30]}, all_logits=True)
    restore = _rerun(cache)
    every = model(inputs.input_ids, inputs.positions, inputs.attn, cache.kv_caches, inputs.logits_indices)
    after = [t.clone() for pair in cache.kv_caches for t in pair]
    argmax_rows, logits_rows = torch.tensor([10, 0, 3, 6, 3]), torch.tensor([6, 1])
    for block_bytes in (native_step.ARGMAX_BLOCK_BYTES, 4 * 16 * 5, 4 * 48 * 5, 4 * 40 * 5 + 8, 12):
        monkeypatch.setattr(native_step, "ARGMAX_BLOCK_BYTES", block_bytes)
        for cols in (vocab, vocab - 5, 17, 1):
            for rows, pieces in ((logits_rows, 256), (logits_rows[:0], 256), (logits_rows, 3)):
                monkeypatch.setattr(native_step, "STEP_ROWS", pieces)
                restore()
                logits, tokens = model.forward_rows(
                    inputs.input_ids, inputs.positions, inputs.attn, cache.kv_caches, rows, argmax_rows, cols
                )
                assert torch.equal(tokens, every[argmax_rows, :cols].argmax(dim=-1)), (block_bytes, cols, pieces)
                assert torch.equal(logits, every[rows])
                assert all(torch.equal(a, b) for a, b in zip(after, [t for pair in cache.kv_caches for t in pair]))


def test_argmax_rows_keep_the_first_of_equal_maxima_and_the_first_nan_across_blocks(
    quantized, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fold of each block's argmax into a row's answer is torch's rule over the whole row: of equal
    maxima in different blocks the first, and the first NaN wherever the row holds one (even before a larger
    value, and after one). A dense head (float32 rows) whose rows are multiples of one vector by powers of two
    makes exact ties: every row's logits are those multiples of one number."""
    hidden = quantized.config.hidden_size
    u = torch.randn(hidden, generator=torch.Generator().manual_seed(3))
    scale = torch.ones(80)
    scale[[20, 37, 70]] = 4.0  # the largest where u.x > 0: ties in blocks 1, 2 and 4 of 16 columns
    scale[[25, 38]] = -4.0  # the largest where u.x < 0: ties in blocks 1 and 2
    heads = {"ties": scale[:, None] * u}
    heads["nan"] = heads["ties"].clone()
    heads["nan"][[33, 64]] = float("nan")  # after the first largest, before the later ones
    monkeypatch.setattr(native_step, "ARGMAX_BLOCK_BYTES", 4 * 16 * 6)  # 16 columns a block for 6 rows
    cache = PagedCache(quantized.config, num_blocks=16, block_size=4)
    inputs = cache.step({0: [5, 9, 17, 3, 44], 1: [60, 2]}, all_logits=True)
    restore = _rerun(cache)
    rows = torch.tensor([0, 1, 2, 4, 5, 6])
    for name, weight in heads.items():
        step, why = native_step_for(quantized)
        assert step is not None, why
        step._keep.append(weight)
        step._model.head = native_step._Table(native_step._Linear(), weight.data_ptr(), weight.shape[0])
        step._vocab = weight.shape[0]
        restore()
        every, none = step(inputs.input_ids, inputs.positions, inputs.attn, cache.kv_caches, inputs.logits_indices)
        assert none.shape == (0,)
        positive = every[:, 20] > 0
        assert positive.any() and (~positive).any(), "the rows should have u.x of both signs"
        if name == "ties":
            assert torch.equal(every[:, 20], every[:, 70]) and torch.equal(every[:, 25], every[:, 38])
        for cols in (80, 37, 22):
            restore()
            _, tokens = step(inputs.input_ids, inputs.positions, inputs.attn, cache.kv_caches, rows[:0], False,
                             rows, cols)  # fmt: skip
            want = every[rows, :cols].argmax(dim=-1)
            assert torch.equal(tokens, want), (name, cols)
            if name == "nan" and cols > 33:  # every row's first NaN, before its larger values
                assert set(tokens.tolist()) == {33}
            else:  # the first of each row's equal maxima: 20 (u.x > 0), 25 or, at 22 columns, 0 (u.x < 0)
                assert set(tokens.tolist()) == {20, 25 if cols > 25 else 0}


def test_argmax_rows_outside_the_step_or_columns_outside_the_head_write_nothing(quantized) -> None:
    """An argmax row outside the step, or `argmax_cols` outside [1, V], is a ValueError with nothing written
    to the pool."""
    cache = PagedCache(quantized.config, num_blocks=8, block_size=4)
    inputs = cache.step({0: [1, 4, 2]})
    pool = [t.clone() for pair in cache.kv_caches for t in pair]
    vocab, none = quantized.config.vocab_size, torch.tensor([], dtype=torch.int64)
    for rows, cols, message in (
        (torch.tensor([3]), None, "outside the step"),
        (torch.tensor([-1]), None, "outside the step"),
        (torch.tensor([2]), 0, "argmax_cols must be in"),
        (torch.tensor([2]), vocab + 1, "argmax_cols must be in"),
    ):
        with pytest.raises(ValueError, match=message):
            quantized.forward_rows(inputs.input_ids, inputs.positions, inputs.attn, cache.kv_caches, none, rows, cols)
        assert all(torch.equal(a, b) for a, b in zip(pool, [t for pair in cache.kv_caches for t in pair]))


def test_argmax_rows_on_the_torch_layers_are_the_argmax_of_their_logits(
    quantized, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the fused step (the torch layers), argmax rows get the argmax of the logits those layers compute
    for them, over the first `argmax_cols` columns, and the logits rows are those `forward` gives for the same
    rows in the same order (torch's matmul may sum differently for another row count)."""
    monkeypatch.setattr(quantized, "native_step", None)
    cache = PagedCache(quantized.config, num_blocks=16, block_size=4)
    inputs = cache.step({0: [5, 9, 17, 3, 44], 1: [60, 2]}, all_logits=True)
    restore = _rerun(cache)
    sampled, argmax = torch.tensor([6, 1]), torch.tensor([0, 3, 6])
    every = quantized(inputs.input_ids, inputs.positions, inputs.attn, cache.kv_caches, torch.cat((sampled, argmax)))
    for cols in (quantized.config.vocab_size, 17):
        restore()
        logits, tokens = quantized.forward_rows(
            inputs.input_ids, inputs.positions, inputs.attn, cache.kv_caches, sampled, argmax, cols
        )
        assert torch.equal(logits, every[:2])
        assert torch.equal(tokens, every[2:, :cols].argmax(dim=-1))
