"""Faithfulness of helexa configurations against helexa's float32 reference and llama.cpp, same token ids.

On the default model (SmolLM2-135M-Instruct; llama.cpp runs the same Q4_1 GGUF natively, helexa its
converted model under each `--helexa-args` configuration), two measures:

- greedy agreement: 8 varied chat prompts, 64 greedy new tokens each (EOS ignored, so every
  continuation has 64 tokens). For a pair of systems, per prompt, the length of the common prefix
  of the two continuations (up to the first divergence); reported as its mean / 64 and the number
  of prompts whose 64 tokens are identical.
- teacher-forced top-1 agreement: a fixed ~1.5k-token text (this repository's README.md and
  docs/*.md, tokenised once by helexa's tokenizer; the same ids go to llama.cpp), one forward over
  it per system; the fraction of positions whose argmax next-token prediction is the same in both.
  helexa: the engine's own loaded model and KV pool (so whatever the configuration changes - dtype,
  quantization - is what is measured), the text fed in chunks through a block table of its batch
  builder with every position's logits (`logits_indices = arange`). llama.cpp: its C API, one
  sequence fed in n_batch chunks with every position's logits. Also reported per system: how often
  that argmax is the text's actual next token.

Pairs: each configuration against `--reference` (default `quantization=none`, the float32
dequantised model; added to the configurations if missing), and each configuration against llama.cpp.

    python bench/agreement.py                                  # configs: dtype=float32, quantization=auto/none
    python bench/agreement.py --helexa-args dtype=bfloat16 --reference dtype=float32
    python bench/agreement.py --quick                          # 3 prompts x 16 tokens, 256-token text

Each `--helexa-args` item is one helexa configuration: comma-separated `EngineConfig` fields
(`key=value`, as `helexa.LLM(None, **engine_args)` takes them), as in bench/peers.py. llama.cpp
comes from `.peers/` (`bash bench/setup_llama_cpp.sh`); without it only helexa pairs are measured.
Writes `bench/results/agreement.md`.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peer_llama_cpp import BUILD_HINT, LlamaCppModel, import_llama_cpp  # noqa: E402  (bench/: the llama.cpp peer)
from peers import (  # noqa: E402  (bench/peers.py: shared prompts and config parsing)
    CHAT_PROMPTS,
    DEFAULT_MODEL,
    RESULTS,
    add_helexa_args,
    chat_ids,
    default_gguf,
    docs_text,
    load_tokenizer,
    parse_config,
)

from helexa import LLM, SamplingParams  # noqa: E402

# Eight varied prompts: poetry, explanation, science, code, arithmetic, description, list, translation.
DEFAULT_CONFIGS = ["dtype=float32", "quantization=auto", "quantization=none"]
AGREEMENT_PROMPTS = [CHAT_PROMPTS[i] for i in (0, 1, 3, 5, 8, 9, 12, 14)]


@dataclass
class SystemOutputs:
    """What one system produced on the shared inputs."""

    name: str
    greedy: list[list[int]]  # per prompt, the new tokens
    tf_argmax: torch.Tensor  # (T,) int64: argmax next-token prediction at each text position
    seconds: float


def helexa_outputs(
    label: str, engine_args: dict[str, Any], prompts: list[list[int]], new_tokens: int, text_ids: list[int], chunk: int
) -> SystemOutputs:
    start = time.perf_counter()
    llm = LLM(None, **{"max_num_seqs": max(8, len(prompts)), "num_blocks": 1024, **engine_args})
    print(f"  loaded ({llm.engine.dtype})", flush=True)
    try:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        greedy = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        print(f"  greedy: {len(prompts)} x {new_tokens} tokens", flush=True)
        tf = helexa_teacher_forced(llm, text_ids, chunk)
        print(f"  teacher-forced: {len(text_ids)} positions", flush=True)
    finally:
        del llm
        gc.collect()
    return SystemOutputs(f"helexa {label}", greedy, tf, time.perf_counter() - start)


@torch.inference_mode()
def helexa_teacher_forced(llm: LLM, ids: list[int], chunk: int) -> torch.Tensor:
    """Argmax next-token prediction at every position of `ids`, from the engine's own model and KV pool.

    The text goes through one block table the engine's KV owner holds for it, in `chunk`-token steps (as a
    chunked prefill does), each step asking for the logits of all its rows. The table's blocks go
    back to the pool after; the engine must be idle (it is, between `generate` calls)."""
    runner, kv = llm.engine.runner, llm.engine.kv
    assert runner is not None, "the engine has no loaded model (poisoned)"
    device, kv_caches = runner.device, runner.pool.kv_caches()
    key = "agreement-teacher-forced"
    kv.open(key, list(ids))
    kv.start(key, list(ids))  # no pin: nothing shared, the whole text is computed
    preds = []
    try:
        for start in range(0, len(ids), chunk):
            piece = ids[start : start + chunk]
            attn = kv.build_step([(key, len(piece))])  # evicts cached blocks when the empty ones are short
            input_ids = torch.tensor(piece, dtype=torch.int64, device=device)
            positions = torch.arange(start, start + len(piece), dtype=torch.int64, device=device)
            rows = torch.arange(len(piece), dtype=torch.int64, device=device)
            logits = runner.model(input_ids, positions, attn, kv_caches, rows)  # (n, V) float32
            preds.append(logits.argmax(dim=-1).cpu())
    finally:
        kv.drop_table(key)
        kv.close(key)
    return torch.cat(preds)


def llama_cpp_outputs(
    lib, gguf: Path, prompts: list[list[int]], new_tokens: int, text_ids: list[int], threads: int
) -> SystemOutputs:
    start = time.perf_counter()
    model = LlamaCppModel(lib, gguf, threads)
    try:
        per_seq = max(len(text_ids), max(len(p) for p in prompts) + new_tokens) + 8
        ctx = model.context(n_seq_max=len(prompts), n_ctx_per_seq=-(-per_seq // 256) * 256)
        try:
            greedy, _, _ = ctx.greedy(prompts, new_tokens)
            print(f"  greedy: {len(prompts)} x {new_tokens} tokens (one batch, a seq_id per prompt)", flush=True)
            ctx.clear()
            tf = torch.from_numpy(ctx.prefill(text_ids, seq=0, all_logits=True).argmax(axis=1)).long()
            print(f"  teacher-forced: {len(text_ids)} positions", flush=True)
        finally:
            ctx.close()
    finally:
        model.close()
    return SystemOutputs("llama.cpp", greedy, tf, time.perf_counter() - start)


def prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class PairResult:
    a: str
    b: str
    greedy_prefix: float  # mean common-prefix length / new tokens
    greedy_exact: int
    tf_agreement: float


def compare(a: SystemOutputs, b: SystemOutputs, new_tokens: int) -> PairResult:
    lengths = [prefix_len(x, y) for x, y in zip(a.greedy, b.greedy)]
    n = min(len(a.tf_argmax), len(b.tf_argmax))
    tf = (a.tf_argmax[:n] == b.tf_argmax[:n]).float().mean().item()
    return PairResult(
        a.name, b.name, sum(lengths) / (len(lengths) * new_tokens), sum(v == new_tokens for v in lengths), tf
    )


def report(
    pairs: list[PairResult],
    systems: list[SystemOutputs],
    text_ids: list[int],
    args: argparse.Namespace,
    n_prompts: int,
    failures: list[str],
    peer: bool,
) -> str:
    targets = torch.tensor(text_ids[1:])
    lines = [
        f"# agreement — {time.strftime('%Y-%m-%d')}, {DEFAULT_MODEL}, CPU, {args.threads} threads",
        "",
        f"Greedy: {n_prompts} chat prompts x {args.new_tokens} new tokens (EOS ignored); prefix = tokens equal up to "
        f"the first divergence, mean / {args.new_tokens}. Teacher-forced: {len(text_ids)} tokens of README.md + "
        "docs/*.md, share of positions with the same argmax.",
        "",
        "| pair | greedy prefix agreement | greedy identical | teacher-forced top-1 agreement |",
        "|---|---|---|---|",
    ]
    for p in pairs:
        lines.append(
            f"| {p.a} vs {p.b} | {p.greedy_prefix:.3f} | {p.greedy_exact}/{n_prompts} | {100 * p.tf_agreement:.2f}% |"
        )
    lines += ["", "| system | argmax = the text's next token | seconds |", "|---|---|---|"]
    for s in systems:
        acc = (s.tf_argmax[: len(targets)] == targets).float().mean().item()
        lines.append(f"| {s.name} | {100 * acc:.2f}% | {s.seconds:.0f} |")
    if failures:
        lines += ["", *[f"- FAILED: {f}" for f in failures]]
    if not peer:
        lines += ["", f"llama.cpp was not measured: {BUILD_HINT}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_helexa_args(parser, DEFAULT_CONFIGS)
    parser.add_argument(
        "--reference", default="quantization=none", help="the helexa configuration every other is compared with"
    )
    parser.add_argument("--prompts", type=int, default=len(AGREEMENT_PROMPTS))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--tf-tokens", type=int, default=1536, help="tokens of the teacher-forced text")
    parser.add_argument("--chunk", type=int, default=512, help="helexa teacher-forced prefill chunk")
    parser.add_argument("--threads", type=int, default=2, help="torch threads and llama.cpp n_threads")
    parser.add_argument("--gguf", type=Path, default=None, help="the GGUF file (default: the default model's)")
    parser.add_argument("--no-llama-cpp", action="store_true", help="compare helexa configurations only")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 3 prompts x 16 tokens, 256-token text")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.new_tokens, args.tf_tokens = 3, 16, 256
    torch.set_num_threads(args.threads)

    labels = list(dict.fromkeys([args.reference, *args.helexa_args]))  # the reference first, no repeats
    tokenizer = load_tokenizer()
    prompts = chat_ids(tokenizer, AGREEMENT_PROMPTS[: args.prompts])
    text_ids = tokenizer.encode(docs_text())[: args.tf_tokens]
    print(
        f"prompts={[len(p) for p in prompts]} tokens, {args.new_tokens} new each; teacher-forced text "
        f"{len(text_ids)} tokens; threads={args.threads}; reference: helexa {args.reference}",
        flush=True,
    )

    systems: dict[str, SystemOutputs] = {}
    failures: list[str] = []
    for label in labels:
        print(f"[helexa {label}]", flush=True)
        try:
            systems[label] = helexa_outputs(label, parse_config(label), prompts, args.new_tokens, text_ids, args.chunk)
        except Exception as exc:  # e.g. a field this checkout's EngineConfig does not have yet
            print(f"  failed: {type(exc).__name__}: {exc}", flush=True)
            failures.append(f"helexa {label}: {type(exc).__name__}: {exc}")
        gc.collect()
    peer: SystemOutputs | None = None
    lib = None if args.no_llama_cpp else import_llama_cpp()
    if lib is not None:
        print("[llama.cpp]", flush=True)
        peer = llama_cpp_outputs(lib, args.gguf or default_gguf(), prompts, args.new_tokens, text_ids, args.threads)

    pairs: list[PairResult] = []
    ref = systems.get(args.reference)
    for label, s in systems.items():
        if ref is not None and label != args.reference:
            pairs.append(compare(s, ref, args.new_tokens))
    if peer is not None:
        pairs += [compare(s, peer, args.new_tokens) for s in systems.values()]
    table = report(
        pairs, [*systems.values(), *([peer] if peer else [])], text_ids, args, len(prompts), failures, peer is not None
    )
    print()
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "agreement.md").write_text(table + "\n")
    print(f"wrote {args.out / 'agreement.md'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
