"""Structured output's cost per engine step: 16 concurrent requests constrained by a JSON schema against
the same 16 requests free, in the same run, on the default model (49,152-token vocabulary masks).

    python bench/structured.py            # SmolLM2-135M-Instruct, CPU float32
    python bench/structured.py --quick    # 4 requests, fewer tokens

Writes `bench/out/structured.md` and `bench/out/structured.png`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helexa.config import EngineConfig  # noqa: E402
from helexa.engine.engine import Engine  # noqa: E402
from helexa.model.sampling import SamplingParams  # noqa: E402
from helexa.model.sampling.grammar import json_schema_grammar  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "steps": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 6},
        "done": {"type": "boolean"},
    },
    "required": ["title", "steps", "done"],
    "additionalProperties": False,
}


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Serve every prompt at once; step the engine directly and time each step."""
    handles = [engine.submit(p, params) for p in prompts]
    times, open_ids, texts = [], {h.request_id for h in handles}, {h.request_id: [] for h in handles}
    while open_ids:
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        for h in handles:
            while (e := h.stream.get(timeout=0)) is not None:
                texts[h.request_id].append(e.text)
                if e.finished:
                    open_ids.discard(h.request_id)
    decode = sorted(times[2:]) or sorted(times)  # the first steps prefill
    valid = 0
    for parts in texts.values():
        try:
            json.loads("".join(parts))
            valid += 1
        except ValueError:
            pass
    return {"steps": len(times), "median_ms": 1e3 * decode[len(decode) // 2], "valid": valid, "n": len(handles)}


def mask_cost(engine: Engine, grammar: str, rows: int, repeats: int = 50) -> float:
    """Milliseconds to fill `rows` constraints' masks and apply them to (rows, vocab) logits, one step."""
    from helexa.model.sampling.bitmask import allocate_bitmask, masked_logits

    constraints = [engine.grammar_tokenizer.constraint(grammar) for _ in range(rows)]
    vocab = constraints[0].vocab_size
    logits = torch.randn(rows, vocab)
    t0 = time.perf_counter()
    for _ in range(repeats):
        bitmask = allocate_bitmask(rows, vocab)
        for i, c in enumerate(constraints):
            c.fill(bitmask, i)
        masked_logits(logits, bitmask)
    return 1e3 * (time.perf_counter() - t0) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.max_tokens = 4, 24
    engine = Engine(EngineConfig.of(device="cpu", dtype="float32", attention_backend="torch", num_blocks=2048,
                                    max_num_seqs=32))  # fmt: skip
    tok = engine.tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": f"Plan task {i} as JSON."}], add_generation_prompt=True)
        for i in range(args.requests)
    ]
    json_schema_grammar({"type": "object"})  # imports llguidance (and its torch kernels) outside the timing
    t0 = time.perf_counter()
    grammar = json_schema_grammar(SCHEMA)
    compile_ms = 1e3 * (time.perf_counter() - t0)
    t0 = time.perf_counter()
    engine.grammar_tokenizer.constraint(grammar)
    first_ms = 1e3 * (time.perf_counter() - t0)  # builds the vocabulary's token trie once
    mask_ms = mask_cost(engine, grammar, args.requests)
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=1, grammar=grammar)
    results = {"constrained": run(engine, prompts, constrained)}
    # the baseline runs as many steps, over the same context lengths (free answers ignore EOS)
    free = SamplingParams(max_tokens=results["constrained"]["steps"] - 1, temperature=0.7, seed=1, ignore_eos=True)
    results = {"free": run(engine, prompts, free), **results}
    base = results["free"]["median_ms"]
    lines = [
        "# Structured output: per-step cost",
        "",
        f"Default model, CPU float32, {torch.get_num_threads()} threads; {args.requests} concurrent requests, "
        f"at most {args.max_tokens} tokens, temperature 0.7. Schema compile {compile_ms:.1f} ms; first "
        f"constraint for this vocabulary {first_ms:.0f} ms (once per model). Filling and applying the "
        f"{args.requests} rows' masks alone: {mask_ms:.2f} ms a step.",
        "",
        "| requests | median decode step | vs free | steps | valid JSON |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        valid = f"{r['valid']}/{r['n']}" if name == "constrained" else "-"
        lines.append(f"| {name} | {r['median_ms']:.1f} ms | {r['median_ms'] / base:.2f}x | {r['steps']} | {valid} |")
    text = "\n".join(lines) + "\n"
    print(text)
    OUT.mkdir(exist_ok=True)
    (OUT / "structured.md").write_text(text)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(list(results), [r["median_ms"] for r in results.values()])
    ax.set(ylabel="median decode step (ms)", title=f"{args.requests} concurrent requests")
    fig.tight_layout()
    fig.savefig(OUT / "structured.png", dpi=120)
    print(f"wrote {OUT / 'structured.md'} and .png")


if __name__ == "__main__":
    main()
