"""The fused CPU decode step (`helexa.model.quant.native_decode`) against the model's own torch path:
the same logits and the same cache writes, step after step, for every architecture and layout; its
attention against the reference backend; and when a model or a step does not get it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helexa.kernels import reference
from helexa.model.loader import load_model
from helexa.model.quant import native
from helexa.model.quant.native_decode import native_decode_for, paged_decode
from tests.support.models import PagedCache, make_tiny_model

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernel: {native.unavailable_reason()}")


@pytest.mark.parametrize(
    ("heads", "kv_heads", "d", "block_size"), [(4, 2, 16, 4), (6, 6, 32, 8), (8, 1, 64, 16), (16, 1, 8, 4)]
)
def test_paged_decode_matches_the_reference(heads: int, kv_heads: int, d: int, block_size: int) -> None:
    """Lengths across block boundaries and across the C code's chunks of 128 keys (merged by their
    maxima and sums), GQA groups of 1 to 16 query heads per KV head."""
    g = torch.Generator().manual_seed(heads * d)
    lens = [1, block_size, block_size + 1, 5 * block_size - 3, 37, 128, 129, 300]
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    k_cache, v_cache = (torch.full((num_blocks, block_size, kv_heads, d), float("nan")) for _ in range(2))  # unwritten
    order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # scattered blocks; block 0 pads
    width = max(-(-n // block_size) for n in lens) + 1
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for b, n in enumerate(lens):
        for i in range(-(-n // block_size)):
            block = order.pop()
            tables[b, i] = block
            rows = min(block_size, n - i * block_size)
            k_cache[block, :rows] = torch.randn(rows, kv_heads, d, generator=g)
            v_cache[block, :rows] = torch.randn(rows, kv_heads, d, generator=g)
    q = torch.randn(len(lens), heads, d, generator=g) * 2
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    want = reference.paged_attention(
        q.double(), k_cache.double(), v_cache.double(), tables, seq_lens, torch.arange(len(lens) + 1, dtype=torch.int32)
    )
    got = paged_decode(q, k_cache, v_cache, tables, seq_lens)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)


def test_paged_decode_checks_its_inputs() -> None:
    q, cache = torch.randn(1, 2, 12), torch.randn(4, 4, 2, 12)  # D = 12: not a multiple of 8
    tables, lens = torch.ones(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="D % 8"):
        paged_decode(q, cache, cache, tables, lens)
    q, cache = torch.randn(1, 2, 16), torch.randn(4, 4, 2, 16)
    with pytest.raises(ValueError, match="int32"):
        paged_decode(q, cache, cache, tables.long(), lens)


def _run(model, cache: PagedCache, tokens: dict[int, list[int]], fused: bool) -> tuple[torch.Tensor, bool]:
    """(logits, whether the fused step computed them) of one step, `fused=False` forcing the layers."""
    step = cache.step(tokens)
    saved, results = model.native_decode, []
    model.native_decode = (lambda *args: results.append(saved(*args)) or results[-1]) if fused else None
    try:
        logits = model(step.input_ids, step.positions, step.attn, cache.kv_caches, step.logits_indices)
    finally:
        model.native_decode = saved
    return logits, any(r is not None for r in results)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # plain, q|k|v bias, per-head q/k norms
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_fused_decode_matches_the_layers(tmp_path: Path, arch: str, method: str) -> None:
    """Both paths quantize their activations to int8 per block of 32 before each projection, and their
    float32 norms, RoPE and softmax round differently in the last bit: now and then a value lands on
    the other side of a rounding boundary and one row differs by about one int8 step of one block
    (a few tenths of a percent of the logits). So each step starts both from the same cache, most
    rows must agree to float32 precision, and every row within 2%."""
    path = make_tiny_model(tmp_path, arch, intermediate_size=128, num_hidden_layers=3)
    model = load_model(path, dtype="float32", attention_backend="torch", quantization=method)
    assert model.native_decode is not None
    prompts = {0: [5, 9, 17, 3, 44, 8, 21], 1: [60, 2], 2: [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]}
    fused, layers = (PagedCache(model.config, num_blocks=24, block_size=4) for _ in range(2))  # same seed: equal
    for cache in (fused, layers):
        assert _run(model, cache, prompts, fused=True)[1] is False  # a prefill never takes the fused step
    g = torch.Generator().manual_seed(1)
    exact_rows = rows = 0
    for _ in range(6):  # decode steps, every sequence one token; crossing block boundaries
        for (fk, fv), (lk, lv) in zip(fused.kv_caches, layers.kv_caches):
            fk.copy_(lk)
            fv.copy_(lv)
        tokens = {i: [int(torch.randint(0, 320, (1,), generator=g))] for i in prompts}
        want, _ = _run(model, layers, tokens, fused=False)
        got, took = _run(model, fused, tokens, fused=True)
        assert took
        scale = float(want.abs().max())
        torch.testing.assert_close(got, want, rtol=0, atol=0.02 * scale)
        exact_rows += int(((got - want).abs().amax(dim=1) <= 1e-5 * scale).sum())
        rows += want.shape[0]
        written = torch.zeros(24, 4, dtype=torch.bool)  # this step's slots
        for seq in fused.seqs.values():
            pos = len(seq.tokens) - 1
            written[seq.blocks[pos // 4], pos % 4] = True
        for (fk, fv), (lk, lv) in zip(fused.kv_caches, layers.kv_caches):
            for f, ref in ((fk, lk), (fv, lv)):
                assert torch.equal(f[~written], ref[~written])  # nothing else in the pool changes
                torch.testing.assert_close(f[written], ref[written], rtol=0, atol=0.02 * float(ref.abs().max()))
    assert exact_rows >= rows * 2 // 3, f"only {exact_rows} of {rows} rows agree to float32 precision"


def test_models_and_steps_the_fused_step_does_not_take(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = make_tiny_model(tmp_path, "llama", intermediate_size=128)
    dense = load_model(path, dtype="float32", attention_backend="torch")
    assert dense.native_decode is None
    assert "o_proj" in native_decode_for(dense)[1]
    bf16 = load_model(path, dtype="bfloat16", attention_backend="torch", quantization="int8")
    assert bf16.native_decode is None and "float32" in native_decode_for(bf16)[1]
    model = load_model(path, dtype="float32", attention_backend="torch", quantization="int8")
    fused = model.native_decode
    assert fused is not None
    cache = PagedCache(model.config, num_blocks=8, block_size=4)
    before = [t.clone() for pair in cache.kv_caches for t in pair]
    step = cache.step({0: [1, 2, 3]})  # a prefill: the layers' job; nothing written
    hidden = torch.randn(3, model.config.hidden_size)
    rope = (torch.ones(3, model.config.head_dim), torch.zeros(3, model.config.head_dim))
    assert fused(hidden, rope, step.attn, cache.kv_caches) is None
    step = cache.step({0: [4]})
    half = [(k.half(), v.half()) for k, v in cache.kv_caches]  # caches it cannot read
    assert fused(hidden[:1], (rope[0][:1], rope[1][:1]), step.attn, half) is None
    assert all(torch.equal(a, b) for a, b in zip(before, [t for pair in cache.kv_caches for t in pair]))
    monkeypatch.setenv("HELEXA_CPU_DECODE", "torch")
    assert native_decode_for(model) == (None, "HELEXA_CPU_DECODE=torch")


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
