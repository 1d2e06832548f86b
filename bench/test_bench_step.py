"""One decode step of the default model (SmolLM2-135M from its Q4_1 GGUF) on the CPU: the fused
native step (`helexa.model.quant.native_decode`, the whole decoder stack in one C call) against the
model's torch layers (the same quantized matmuls, with norms, RoPE, the K/V write and attention as
torch operations), measured in the same run on the same weights and cache state.

`make bench` runs it with pytest-benchmark and writes `bench/out/decode_step.md` and `.png`. Each
step decodes one token for every sequence of the batch (`CASES`: sequences x tokens of context
each; the long contexts are where attention, not the weights, dominates) and includes the logits
head (what the engine runs per decode step, less sampling).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helexa.model.loader import load_model
from helexa.model.quant import native
from helexa.model.weights.pull import DEFAULT_MODEL, resolve_model
from tests.support.models import PagedCache

OUT_DIR = Path(__file__).parent / "out"
CASES = [(1, 128), (8, 128), (16, 128), (1, 4096), (4, 4096)]  # (sequences, context tokens each)
PREFILL_CHUNK = 1024
IMPLS = ["fused", "layers"]
_RESULTS: list[dict] = []

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernel: {native.unavailable_reason()}")


@pytest.fixture(scope="module")
def model():
    loaded = load_model(resolve_model(DEFAULT_MODEL), dtype="float32", quantization="auto")
    assert loaded.native_decode is not None, "the default model should get the fused decode step"
    return loaded


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    if _RESULTS:
        _write_report(_RESULTS)


def _write_report(results: list[dict]) -> None:
    """`bench/out/decode_step.md` (a table with each step's speed-up over the layers) and `.png`."""
    OUT_DIR.mkdir(exist_ok=True)
    by_key = {(r["batch"], r["context"], r["impl"]): r["ms"] for r in results}
    lines = [
        f"# decode step, default model, CPU ({torch.get_num_threads()} threads)",
        "",
        "| sequences | context | impl | median ms | tokens/s | vs layers |",
        "|---:|---:|---|---:|---:|---:|",
    ]
    for r in results:
        base = by_key.get((r["batch"], r["context"], "layers"))
        ratio = f"{base / r['ms']:.2f}x" if base else "-"
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['impl']} | {r['ms']:.2f} | {1e3 * r['batch'] / r['ms']:.1f} "
            f"| {ratio} |"
        )
    (OUT_DIR / "decode_step.md").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for i, impl in enumerate(IMPLS):
        ms = [by_key.get((b, c, impl), 0.0) for b, c in CASES]
        ax.bar([j + 0.4 * i for j in range(len(CASES))], ms, width=0.4, label=impl)
    ax.set_xticks([j + 0.2 for j in range(len(CASES))], [f"{b} x {c}" for b, c in CASES], fontsize=8)
    ax.set_xlabel("sequences x context tokens")
    ax.set_ylabel("ms per decode step (median)")
    ax.set_title("default model, one decode step", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT_DIR / "decode_step.png", dpi=120)
    plt.close(fig)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("batch", "context"), CASES)
def test_decode_step(benchmark, model, batch: int, context: int, impl: str) -> None:
    cache = PagedCache(model.config, num_blocks=batch * (context // 16 + 2) + 1, block_size=16)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(0, model.config.vocab_size, (context,), generator=g).tolist()
        for start in range(0, context, PREFILL_CHUNK):
            prefill = cache.step({i: prompt[start : start + PREFILL_CHUNK]})
            model(prefill.input_ids, prefill.positions, prefill.attn, cache.kv_caches, prefill.logits_indices)
    step = cache.step({i: [7] for i in range(batch)})  # one decode step, re-run in place: same slots
    fused = model.native_decode
    model.native_decode = fused if impl == "fused" else None
    try:
        benchmark.pedantic(
            lambda: model(step.input_ids, step.positions, step.attn, cache.kv_caches, step.logits_indices),
            rounds=15,
            warmup_rounds=2,
        )
    finally:
        model.native_decode = fused
    stats = getattr(benchmark, "stats", None)
    if stats is not None:
        _RESULTS.append({"batch": batch, "context": context, "impl": impl, "ms": stats.stats.median * 1e3})
