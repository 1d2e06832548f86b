"""One step of the default model (SmolLM2-135M from its Q4_1 GGUF) on the CPU: the fused native
step (`helexa.model.quant.native_step`, the whole decoder stack in one C call, the path every step
takes) against the model's torch layers (the same quantized matmuls, with norms, RoPE, the K/V
write and attention as torch operations), measured in the same run on the same weights and cache.

`make bench` runs it with pytest-benchmark and writes `bench/out/step.md` and `.png`. `CASES`:
decode steps (one token for every sequence, after `context` tokens each; the long contexts are
where attention, not the weights, dominates), a 512-token prefill from empty and a 512-token chunk
after 1,536 cached tokens. Each includes the logits head for the rows the engine samples.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.machine import cpu_name
from helexa.model.loader import load_model
from helexa.model.quant import native
from helexa.model.weights.pull import DEFAULT_MODEL, resolve_model
from tests.support.models import PagedCache

OUT_DIR = Path(__file__).parent / "out"
# (kind, sequences, context tokens each before the step, new tokens each in the step)
CASES = [
    ("decode", 1, 128, 1), ("decode", 8, 128, 1), ("decode", 16, 128, 1), ("decode", 1, 4096, 1),
    ("decode", 4, 4096, 1), ("prefill", 1, 0, 512), ("extend", 1, 1536, 512),
]  # fmt: skip
PREFILL_CHUNK = 1024
IMPLS = ["fused", "layers"]
_RESULTS: list[dict] = []

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernel: {native.unavailable_reason()}")


@pytest.fixture(scope="module")
def model():
    loaded = load_model(resolve_model(DEFAULT_MODEL), dtype="float32", quantization="auto")
    assert loaded.native_step is not None, "the default model should get the fused step"
    return loaded


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    if _RESULTS:
        _write_report(_RESULTS)


def _write_report(results: list[dict]) -> None:
    """`bench/out/step.md` (a table with each step's speed-up over the layers) and `.png`."""
    OUT_DIR.mkdir(exist_ok=True)
    by_key = {(r["case"], r["impl"]): r["ms"] for r in results}
    lines = [
        f"# one step, default model, CPU: {cpu_name()} ({torch.get_num_threads()} threads; native kernel "
        f"{'AVX2' if native.available() else native.unavailable_reason()})",
        "",
        "| step | sequences | context | new tokens | impl | median ms | tokens/s | vs layers |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in results:
        kind, batch, context, new = r["case"]
        base = by_key.get((r["case"], "layers"))
        ratio = f"{base / r['ms']:.2f}x" if base else "-"
        lines.append(
            f"| {kind} | {batch} | {context} | {new} | {r['impl']} | {r['ms']:.2f} "
            f"| {1e3 * batch * new / r['ms']:.1f} | {ratio} |"
        )
    (OUT_DIR / "step.md").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for i, impl in enumerate(IMPLS):
        ms = [by_key.get((case, impl), 0.0) for case in CASES]
        ax.bar([j + 0.4 * i for j in range(len(CASES))], ms, width=0.4, label=impl)
    labels = [f"{k}\n{b} x {c}+{n}" for k, b, c, n in CASES]
    ax.set_xticks([j + 0.2 for j in range(len(CASES))], labels, fontsize=7)
    ax.set_xlabel("step: sequences x (context + new tokens)")
    ax.set_ylabel("ms per step (median)")
    ax.set_yscale("log")
    ax.set_title("default model, one step: fused C step vs torch layers", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT_DIR / "step.png", dpi=120)
    plt.close(fig)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}+{c[3]}")
def test_step(benchmark, model, case: tuple[str, int, int, int], impl: str) -> None:
    _, batch, context, new = case
    cache = PagedCache(model.config, num_blocks=batch * ((context + new) // 16 + 2) + 1, block_size=16)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(0, model.config.vocab_size, (context,), generator=g).tolist()
        for start in range(0, context, PREFILL_CHUNK):
            prefill = cache.step({i: prompt[start : start + PREFILL_CHUNK]})
            model(prefill.input_ids, prefill.positions, prefill.attn, cache.kv_caches, prefill.logits_indices)
    new_tokens = torch.randint(0, model.config.vocab_size, (new,), generator=g).tolist()
    step = cache.step({i: new_tokens for i in range(batch)})  # re-run in place: the same slots each round
    fused = model.native_step
    model.native_step = fused if impl == "fused" else None
    try:
        benchmark.pedantic(
            lambda: model(step.input_ids, step.positions, step.attn, cache.kv_caches, step.logits_indices),
            rounds=15 if new == 1 else 5,
            warmup_rounds=2 if new == 1 else 1,
        )
    finally:
        model.native_step = fused
    stats = getattr(benchmark, "stats", None)
    if stats is not None:
        _RESULTS.append({"case": case, "impl": impl, "ms": stats.stats.median * 1e3})
