"""Accuracy of `--kv-cache-dtype fp8` against the unquantized KV cache (`auto`), same weights and tokens.

On the default model (SmolLM2-135M-Instruct, float32 on CPU), two engines are loaded with
`helexa.LLM(None, ...)`: `kv_cache_dtype="auto"` and `"fp8"` (scales calibrated at load, as
served). Two measures, each against `auto`:

- teacher-forced top-1 agreement: this repository's README.md and docs/*.md, tokenised once and
  cut to `--context` tokens (default 2048), fed through each engine's own model, KV pool and batch
  builder in chunks of 512 with every position's logits; the share of positions whose argmax
  next-token prediction equals auto's (overall and over the last quarter of the context, where
  the most quantized keys and values are attended), the mean KL(auto || fp8) per position, and each
  run's perplexity and next-token accuracy on the text itself.
- greedy agreement: chat prompts, `--max-tokens` greedy tokens each (EOS ignored): per prompt the
  length of the common prefix of the two continuations; reported as its mean / max_tokens and the
  number of prompts whose continuations are identical.

Two more fp8 rows show what the calibration buys, on the same pool: scale 1.0 for every head (no
calibration, vLLM's default without checkpoint scales) and the calibrated scales without the 2x
margin (teacher-forced only). The prefix cache is off, so no block written under one set of scales
is read under another.

    python bench/kv_fp8_accuracy.py                  # ~3 minutes on 2 CPU cores
    python bench/kv_fp8_accuracy.py --write          # also append the table to bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from helexa import LLM
from helexa.kvcache import FP8_SCALE_MARGIN
from helexa.model.sampling import SamplingParams

REPO = Path(__file__).resolve().parent.parent
DOCS = [
    REPO / "README.md",
    REPO / "docs" / "design.md",
    REPO / "docs" / "architecture.md",
    REPO / "docs" / "reference.md",
]
CHUNK = 512
PROMPTS = [
    "Explain in three sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "What are the main differences between a list and a tuple in Python?",
    "Give me a short recipe for a vegetarian pasta dish.",
    "Summarize the causes of the French Revolution in a paragraph.",
    "List five tips for writing clear technical documentation.",
]


@dataclass
class Forced:
    """One teacher-forced run: log-probabilities (N, V) of every position's next token."""

    logprobs: torch.Tensor

    def top1(self) -> torch.Tensor:
        return self.logprobs.argmax(dim=-1)


@torch.inference_mode()
def teacher_forced(llm: LLM, ids: list[int]) -> Forced:
    """Every position's next-token log-probabilities, the text fed through the engine's own model, pool
    and KV owner in chunks of `CHUNK` tokens (blocks released after)."""
    runner, kv = llm.engine.runner, llm.engine.kv
    assert runner is not None
    key = "fp8-teacher-forced"
    kv.open(key, list(ids))
    kv.start(key, list(ids))  # no pin: nothing shared, the whole text is computed
    out = []
    try:
        for start in range(0, len(ids), CHUNK):
            chunk = ids[start : start + CHUNK]
            attn = kv.build_step([(key, len(chunk))])
            tokens = torch.tensor(chunk, dtype=torch.int64)
            positions = torch.arange(start, start + len(chunk), dtype=torch.int64)
            logits = runner.model(tokens, positions, attn, runner.pool.kv_caches(), torch.arange(len(chunk)))
            out.append(logits[:, : runner.sample_vocab_size].log_softmax(dim=-1))
    finally:
        kv.drop_table(key)
        kv.close(key)
    return Forced(torch.cat(out))


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def forced_row(name: str, run: Forced, base: Forced, ids: list[int]) -> dict[str, str]:
    n = len(ids)
    target = torch.tensor(ids[1:])
    agree = run.top1() == base.top1()  # (N,)
    tail = agree[-(n // 4) :]
    kl = (base.logprobs.exp() * (base.logprobs - run.logprobs)).sum(-1)  # (N,)
    nll = -run.logprobs[:-1].gather(1, target[:, None]).squeeze(1)
    return {
        "run": name,
        "top-1 agreement": f"{agree.float().mean():.4f} ({int(agree.sum())}/{n})",
        "last quarter": f"{tail.float().mean():.4f}",
        "mean KL (nats)": f"{kl.mean():.5f}",
        "perplexity": f"{nll.mean().exp():.3f}",
        "next-token acc.": f"{(run.top1()[:-1] == target).float().mean():.4f}",
    }


def table(rows: list[dict[str, str]]) -> str:
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r.get(h, "") for h in head) + " |" for r in rows]
    return "\n".join(lines)


def _log(start: float, what: str) -> None:
    print(f"[{time.perf_counter() - start:6.1f}s] {what}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=2048, help="teacher-forced context length in tokens")
    parser.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many chat prompts")
    parser.add_argument("--write", action="store_true", help="append the results to bench/RESULTS.md")
    args = parser.parse_args()
    start = time.perf_counter()

    engine_args = dict(dtype="float32", device="cpu", num_blocks=-(-(args.context + 64) // 16) + 64, max_num_seqs=8)
    engine_args |= dict(max_model_len=max(args.context, 512) + 64, max_num_batched_tokens=2048, prefix_cache=False)
    auto = LLM(None, kv_cache_dtype="auto", **engine_args)
    fp8 = LLM(None, kv_cache_dtype="fp8", **engine_args)
    _log(start, "engines loaded")
    tok = auto.tokenizer
    text = "\n\n".join(p.read_text() for p in DOCS)
    ids = tok.encode(text)[: args.context]
    if len(ids) < args.context:
        raise SystemExit(f"the docs give only {len(ids)} tokens; lower --context")
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS[: args.prompts]]
    pool = fp8.engine.pool
    assert pool.kv_scales is not None
    calibrated = pool.kv_scales.clone()  # (L, 2, KVH)

    base = teacher_forced(auto, ids)
    forced = [forced_row("fp8 (calibrated, served)", teacher_forced(fp8, ids), base, ids)]
    _log(start, "teacher-forced auto and fp8")
    base_greedy = greedy(auto, prompts, args.max_tokens)
    fp8_greedy = greedy(fp8, prompts, args.max_tokens)
    _log(start, "greedy auto and fp8")
    pool.set_kv_scales(torch.ones_like(calibrated[:, 0]), torch.ones_like(calibrated[:, 1]))
    forced.append(forced_row("fp8, scale 1.0 (uncalibrated)", teacher_forced(fp8, ids), base, ids))
    one_greedy = greedy(fp8, prompts, args.max_tokens)
    pool.set_kv_scales(calibrated[:, 0] / FP8_SCALE_MARGIN, calibrated[:, 1] / FP8_SCALE_MARGIN)
    forced.append(forced_row("fp8, calibrated without the 2x margin", teacher_forced(fp8, ids), base, ids))
    pool.set_kv_scales(calibrated[:, 0], calibrated[:, 1])
    forced.insert(0, forced_row("auto (float32 KV, the baseline)", base, base, ids))

    greedy_rows = []
    for name, runs in (("fp8 (calibrated, served)", fp8_greedy), ("fp8, scale 1.0 (uncalibrated)", one_greedy)):
        prefix = [common_prefix(a, b) for a, b in zip(runs, base_greedy)]
        greedy_rows.append({
            "run": name,
            f"mean common prefix / {args.max_tokens}": f"{sum(prefix) / len(prefix) / args.max_tokens:.3f}",
            "identical prompts": f"{sum(p == args.max_tokens for p in prefix)}/{len(prefix)}",
            "per prompt": " ".join(map(str, prefix)),
        })  # fmt: skip
    k_amax = calibrated[:, 0] * 448 / FP8_SCALE_MARGIN
    v_amax = calibrated[:, 1] * 448 / FP8_SCALE_MARGIN
    budget_auto, budget_fp8 = auto.engine.budget, fp8.engine.budget
    seconds = time.perf_counter() - start

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    date = datetime.date.today().isoformat()
    cpu = platform.processor() or platform.machine()
    report = "\n".join([
        f"## fp8 KV cache accuracy ({date}, CPU)",
        "",
        f"`python bench/kv_fp8_accuracy.py` (commit {commit.strip()} + working tree; {cpu}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}; {seconds:.0f} s). Default model "
        "(SmolLM2-135M-Instruct) loaded by `helexa.LLM` in float32 (weights as served, `quantization` auto) "
        "with `kv_cache_dtype` auto and fp8; "
        f"fp8 scales calibrated at load (|K| max {float(k_amax.min()):.2f}..{float(k_amax.max()):.2f}, "
        f"|V| max {float(v_amax.min()):.2f}..{float(v_amax.max()):.2f} over the 30 layers x 3 KV heads; "
        f"scale = 2 x max / 448). Same `num_blocks`: {budget_auto.bytes_per_block} B/block float32, "
        f"{budget_fp8.bytes_per_block} B/block fp8.",
        "",
        f"Teacher-forced over {len(ids)} tokens of this repository's README.md and docs (chunks of {CHUNK}), "
        "each run against auto:",
        "",
        table(forced),
        "",
        f"Greedy, {len(prompts)} chat prompts x {args.max_tokens} tokens (EOS ignored), against auto:",
        "",
        table(greedy_rows),
        "",
    ])  # fmt: skip
    print(report)
    if args.write:
        with open(REPO / "bench" / "RESULTS.md", "a") as f:
            f.write("\n" + report)


if __name__ == "__main__":
    main()
