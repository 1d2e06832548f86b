"""Accuracy of the CPU's default 16-bit KV cache (`kv_cache_dtype` auto = float16 under the fused C
step) against a float32 cache, same weights and tokens (issue 36), by bench/kv_fp8_accuracy.py's
method: teacher-forced top-1 agreement over `--context` (2048) tokens of this repository's README
and docs fed through each engine's own model, pool and KV owner in chunks of 512 (overall and over
the last quarter, mean KL, perplexity), and greedy agreement on chat prompts. A third row gives the
noise floor: the float32 cache through the model's torch layers instead of the fused step (the same
math, float32 rounding differing in the last bits): each layer's int8 activation rounding turns any
last-bit difference into a different int8 step now and then, so no change of rounding scores 100%.
A fourth row holds the float16 cache against that third float32 computation: if it agrees with it
as the fused step's float32 does, the float16 cache moves the predictions no more than float32
rounding does.
Two more rows isolate the KV's own precision on the same model's weights dequantised to dense
float32 (`quantization="none"`: no int8 activation rounding), through the torch layers over a float16
and a float32 cache (`tests.support.models.PagedCache`).

    python bench/kv_half_accuracy.py                 # ~3.5 minutes on 2 CPU cores

Prints a table (the bar: top-1 agreement >= 99%) and writes `bench/results/kv_half_accuracy.md`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kv_fp8_accuracy import CHUNK, DOCS, PROMPTS, Forced, common_prefix, forced_row, greedy, table, teacher_forced  # noqa: E402  # noqa: E402

from helexa import LLM  # noqa: E402
from helexa.model.loader import load_model  # noqa: E402
from helexa.model.quant import native  # noqa: E402
from helexa.model.weights.pull import DEFAULT_MODEL, resolve_model  # noqa: E402
from tests.support.models import PagedCache  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main(context: int = 2048, max_tokens: int = 64) -> None:
    start = time.perf_counter()
    engine_args = dict(dtype="float32", device="cpu", num_blocks=-(-(context + 64) // 16) + 64, max_num_seqs=8)
    engine_args |= dict(max_model_len=max(context, 512) + 64, max_num_batched_tokens=2048, prefix_cache=False)
    full = LLM(None, kv_cache_dtype="float32", **engine_args)
    half = LLM(None, kv_cache_dtype="auto", **engine_args)
    assert full.engine.pool.dtype == torch.float32 and half.engine.pool.dtype == torch.float16
    tok = full.tokenizer
    ids = tok.encode("\n\n".join(p.read_text() for p in DOCS))[:context]
    base = teacher_forced(full, ids)
    half_forced = teacher_forced(half, ids)
    rows = [
        forced_row("float32 KV (baseline)", base, base, ids),
        forced_row("float16 KV (auto)", half_forced, base, ids),
    ]
    del half
    os.environ["HELEXA_CPU_STEP"] = "torch"
    layers = LLM(None, kv_cache_dtype="float32", **engine_args)
    assert layers.engine.runner.model.native_step is None
    layers_forced = teacher_forced(layers, ids)
    rows.append(forced_row("float32 KV, torch layers (noise floor)", layers_forced, base, ids))
    rows.append(forced_row("float16 KV (auto) vs the torch layers' float32", half_forced, layers_forced, ids))
    del layers
    os.environ.pop("HELEXA_CPU_STEP")
    dense = load_model(resolve_model(DEFAULT_MODEL), dtype="float32", quantization="none")
    dense_full = _dense_forced(dense, ids, torch.float32)
    rows.append(forced_row("dense weights, float32 KV (baseline of the next row)", dense_full, dense_full, ids))
    rows.append(
        forced_row("dense weights, float16 KV vs float32 KV", _dense_forced(dense, ids, torch.float16), dense_full, ids)
    )
    del dense
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    half = LLM(None, kv_cache_dtype="auto", **engine_args)
    a, b = greedy(full, prompts, max_tokens), greedy(half, prompts, max_tokens)
    prefix = [common_prefix(x, y) for x, y in zip(a, b)]
    text = "\n".join([
        f"# 16-bit KV on the CPU: {len(ids)} tokens teacher-forced, kernel path {native.kernel_path()}, "
        f"{torch.get_num_threads()} threads, {time.perf_counter() - start:.0f} s",
        "",
        table(rows),
        "",
        f"greedy, {len(prompts)} chat prompts x {max_tokens} tokens: mean common prefix "
        f"{sum(prefix) / len(prefix) / max_tokens:.3f}, identical {sum(p == max_tokens for p in prefix)}/{len(prefix)} "
        f"(per prompt: {' '.join(map(str, prefix))}); bytes per block: float32 "
        f"{full.engine.budget.bytes_per_block}, float16 {half.engine.budget.bytes_per_block}",
    ])  # fmt: skip
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kv_half_accuracy.md").write_text(text + "\n")


@torch.inference_mode()
def _dense_forced(model, ids: list[int], dtype: torch.dtype) -> Forced:
    cache = PagedCache(model.config, num_blocks=-(-len(ids) // 16) + 2, block_size=16, dtype=dtype)
    out = []
    for start in range(0, len(ids), CHUNK):
        step = cache.step({0: ids[start : start + CHUNK]}, all_logits=True)
        logits = model(step.input_ids, step.positions, step.attn, cache.kv_caches, step.logits_indices)
        out.append(logits.float().log_softmax(dim=-1))
    return Forced(torch.cat(out))


if __name__ == "__main__":
    main()
