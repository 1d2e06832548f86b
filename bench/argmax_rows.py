"""Greedy rows' tokens taken in the fused CPU step (argmax rows) against their logits sampled after it, on the
same GGUF in the same run: decode speed at 1, 8 and 16 streams (speculative decoding on, as by default, so a
step verifies up to 1 + drafts rows a stream) and each process's peak resident memory.

A greedy request that asks for no logprobs, penalties, logit_bias or grammar needs only the argmax of its
logits. The runner gives such rows to the step as argmax rows: the head is computed `ARGMAX_BLOCK_BYTES` of
logits at a time and each block's argmax folded into the row's token, so the step never writes (and the
sampler never reads) their logits, 196 KiB a row of the default model's 49,152-token vocabulary. "sampled" is
the same engine with that turned off (`ModelRunner.argmax_in_step` false): every row's logits are kept in the
step's reused buffer and the sampler takes their argmax, as before the change. Both give the same tokens
(checked here: each process's outputs are compared).

Each mode runs in a fresh process of its own (its peak RSS, VmHWM, is that engine's alone), the modes
alternating round by round (`--rounds`); speeds are each mode's best round, memory its first round's.

A serving run's steps differ between the modes (speculative decoding sizes its drafts from the step times it
measures), so the step itself is also timed alone (`--step-repeats`, 0 to skip): the model's forward over one
step of S sequences x R rows each (decode rows at a 100-token context, R > 1: a verified draft), through the
step's argmax rows, and through its logits plus `native.argmax_rows` (what the sampler ran for greedy rows),
alternating call by call from the same pool state in this process, at 1 and `--threads` threads; the median.

    python bench/argmax_rows.py                      # the default model (135m), 2 rounds
    python bench/argmax_rows.py --models 135m,1b     # and the 1B-shaped random GGUF (bench/random_gguf.py)
    python bench/argmax_rows.py --quick              # 1 round, 16 new tokens, 1 and 8 streams

Writes `bench/results/argmax_rows.md`, `.png` and `.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from machine import cpu_name, memory_mib  # noqa: E402

RESULTS = BENCH / "results"
MODES = ("in step", "sampled")
STEP_SHAPES = ((1, 1), (1, 6), (16, 1), (8, 6), (16, 4))  # (sequences, rows each) of the timed step


def measure(plan: dict[str, Any]) -> dict[str, Any]:
    """One mode's run of `plan` in this (fresh) process: tok/s per stream count, the share of tokens from
    accepted drafts, each request's token ids, and memory (MiB) after load and at the end (peak)."""
    import torch

    from helexa import LLM, SamplingParams
    from helexa.engine.runner import ModelRunner
    from helexa.model.quant import native

    torch.set_num_threads(plan["threads"])
    if plan["mode"] == "sampled":
        ModelRunner.argmax_in_step = property(lambda self: False)  # type: ignore[assignment, method-assign]
    chat, new_tokens = plan["chat"], plan["new_tokens"]
    blocks = sum(-(-(len(p) + new_tokens + 8) // 16) for p in chat) + 4
    llm = LLM(plan["model_dir"], max_num_seqs=max(plan["streams"]), num_blocks=blocks)
    result: dict[str, Any] = {"loaded": memory_mib(), "decode": {}, "accepted": {}, "tokens": {}}
    result["argmax_in_step"] = llm.engine.runner.argmax_in_step
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([chat[0]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    spec = llm.engine.drafter.stats if llm.engine.drafter is not None else None
    for n in plan["streams"]:
        accepted = spec.accepted_tokens if spec is not None else 0
        outs = llm.generate(chat[:n], greedy, use_tqdm=False)
        window = max(o.timings.total for o in outs) - max(o.timings.ttft for o in outs)  # after every first token
        tokens = sum(len(o.token_ids) - 1 for o in outs)
        result["decode"][str(n)] = tokens / window
        result["accepted"][str(n)] = ((spec.accepted_tokens if spec is not None else 0) - accepted) / tokens
        result["tokens"][str(n)] = [list(o.token_ids) for o in outs]
        print(f"  {plan['mode']:>8}: {n:>2} streams {result['decode'][str(n)]:.1f} tok/s", flush=True)
    result["end"] = memory_mib()
    result["kernel_path"] = native.kernel_path()
    llm.close()
    return result


def time_steps(model_dir: str, thread_counts: list[int], repeats: int) -> list[dict[str, Any]]:
    """The forward of one step, argmax rows against logits + `native.argmax_rows`, per `STEP_SHAPES` and thread
    count: median ms of each over `repeats` calls, alternating, each from the same pool state."""
    import torch

    from helexa.model.loader import load_model

    model = load_model(model_dir, dtype="float32", attention_backend="torch")
    out = []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        for seqs, rows_each in STEP_SHAPES:
            ms = _time_step(model, seqs, rows_each, repeats)
            out.append({"threads": threads, "seqs": seqs, "rows": rows_each, **ms})
            print(f"  step {seqs} x {rows_each} rows, {threads} thread(s): {ms['in step']:.2f} / "
                  f"{ms['sampled']:.2f} ms", flush=True)  # fmt: skip
    return out


def _time_step(model: Any, seqs: int, rows_each: int, repeats: int) -> dict[str, float]:
    """Median ms of each mode's forward of `seqs` sequences x `rows_each` rows after a 100-token context; the
    modes' tokens checked equal."""
    from helexa.model.quant import native
    from tests.support.models import PagedCache

    cache = PagedCache(model.config, num_blocks=seqs * 8 + 1, block_size=16)
    cache.step({s: [(7 * s + 3 * i) % 5000 + 10 for i in range(100)] for s in range(seqs)})
    step = cache.step({s: [11 + j for j in range(rows_each)] for s in range(seqs)}, all_logits=True)
    pool = [t for pair in cache.kv_caches for t in pair]
    saved = [t.clone() for t in pool]
    rows, vocab = step.logits_indices, model.config.vocab_size
    args = (step.input_ids, step.positions, step.attn, cache.kv_caches)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    tokens: dict[str, list[int]] = {}
    for r in range(repeats):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            for t, v in zip(pool, saved):  # the same step from the same pool state each time
                t.copy_(v)
            start = time.perf_counter()
            if mode == "in step":
                tokens[mode] = model.forward_rows(*args, rows[:0], rows, vocab, reuse_logits=True)[1].tolist()
            else:  # the logits, then the sampler's argmax of them
                tokens[mode] = native.argmax_rows(model.forward_rows(*args, rows, reuse_logits=True)[0]).tolist()
            times[mode].append(time.perf_counter() - start)
    if tokens["in step"] != tokens["sampled"]:
        raise SystemExit(f"the modes' tokens differ at {seqs} x {rows_each} rows")
    return {m: statistics.median(t) * 1e3 for m, t in times.items()}


def run_mode(plan: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """`measure` in a fresh process of its own; its result, or `error`."""
    plan_path, result_path = tmp / "plan.json", tmp / "result.json"
    plan_path.write_text(json.dumps(plan))
    result_path.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(plan["threads"])}
    proc = subprocess.run([sys.executable, __file__, "--child", str(plan_path), str(result_path)], env=env)
    if not result_path.is_file():
        return {"error": f"the process exited {proc.returncode} without a result"}
    return json.loads(result_path.read_text())


def report(
    runs: dict[str, dict[str, list[dict[str, Any]]]],
    args: argparse.Namespace,
    path_taken: str,
    steps: dict[str, list[dict[str, Any]]] | None = None,
) -> str:
    """The markdown tables of every model's runs ({model: {mode: [round results]}}) and timed steps
    ({model: `time_steps`' rows})."""
    streams = [int(s) for s in args.streams.split(",")]
    lines = [
        "# Greedy rows' argmax in the fused CPU step, against their logits sampled after it",
        "",
        f"CPU: {cpu_name()}; kernel path {path_taken}; {args.threads} threads; {args.rounds} round(s), the modes"
        f" alternating, a fresh process each; {args.new_tokens} new tokens a stream, greedy, EOS ignored,"
        " speculative decoding on (the default). Speed: each mode's best round; memory: its first round.",
        "",
    ]
    for model, modes in runs.items():
        ok = {m: [r for r in rs if "error" not in r] for m, rs in modes.items()}
        lines += [f"## {model}", ""]
        for m, rs in modes.items():
            for r in rs:
                if "error" in r:
                    lines.append(f"- {m}: a round failed: {r['error']}")
        if not all(ok.values()):
            lines += ["", "(no complete pair of runs)", ""]
            continue
        best = {m: {n: max(r["decode"][str(n)] for r in rs) for n in streams} for m, rs in ok.items()}
        same = all(
            r["tokens"] == ok[MODES[0]][0]["tokens"] for rs in ok.values() for r in rs
        )  # every round of both modes: the same token ids
        lines += ["| | in step | sampled | ratio |", "|---|---:|---:|---:|"]
        for n in streams:
            a, b = best["in step"][n], best["sampled"][n]
            drafted = ok["in step"][0]["accepted"][str(n)]
            lines.append(
                f"| decode, {n} stream(s), tok/s ({drafted:.0%} from drafts) | {a:.1f} | {b:.1f} | {a / b:.2f}x |"
            )
        first = {m: rs[0] for m, rs in ok.items()}
        peak = {m: r["end"]["peak"] for m, r in first.items()}
        loaded = {m: r["loaded"]["rss"] for m, r in first.items()}
        a, b = peak["in step"], peak["sampled"]
        lines.append(f"| peak RSS (MiB) | {a:.1f} | {b:.1f} | {a - b:+.1f} |")
        lines.append(
            f"| peak RSS over the loaded engine's RSS (MiB) | {peak['in step'] - loaded['in step']:.1f} |"
            f" {peak['sampled'] - loaded['sampled']:.1f} | |"
        )
        lines += ["", f"Same token ids in every round of both modes: {'yes' if same else '**no**'}.", ""]
        if steps and steps.get(model):
            lines += [
                f"The step alone (median of {args.step_repeats} calls each, alternating; the same tokens):",
                "",
                "| threads | sequences x rows | in step (ms) | logits + argmax (ms) | ratio |",
                "|---:|---|---:|---:|---:|",
            ]
            for row in steps[model]:
                a, b = row["in step"], row["sampled"]
                lines.append(f"| {row['threads']} | {row['seqs']} x {row['rows']} | {a:.2f} | {b:.2f} | {b / a:.2f}x |")
            lines.append("")
    return "\n".join(lines) + "\n"


def plot(runs: dict[str, dict[str, list[dict[str, Any]]]], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    streams = [int(s) for s in args.streams.split(",")]
    fig, axes = plt.subplots(1, 2 * len(runs), figsize=(6 * len(runs), 3.5), squeeze=False)
    for i, (model, modes) in enumerate(runs.items()):
        ok = {m: [r for r in rs if "error" not in r] for m, rs in modes.items()}
        if not all(ok.values()):
            continue
        speed, memory = axes[0][2 * i], axes[0][2 * i + 1]
        for j, m in enumerate(MODES):
            xs = [k + 0.4 * j for k in range(len(streams))]
            speed.bar(xs, [max(r["decode"][str(n)] for r in ok[m]) for n in streams], width=0.4, label=m)
            memory.bar([j], [ok[m][0]["end"]["peak"]], width=0.6, label=m)
        speed.set_xticks([k + 0.2 for k in range(len(streams))], [f"{n} streams" for n in streams])
        speed.set_ylabel("tok/s")
        speed.set_title(f"{model}: greedy decode")
        speed.legend()
        memory.set_xticks(range(len(MODES)), MODES)
        memory.set_ylabel("peak RSS (MiB)")
        memory.set_title(f"{model}: peak RSS")
        low = min(ok[m][0]["end"]["peak"] for m in MODES)
        memory.set_ylim(low * 0.95, None)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=2, metavar=("PLAN", "RESULT"), help=argparse.SUPPRESS)
    parser.add_argument("--models", default="135m", help="comma-separated: 135m, 1b, 8b (default 135m)")
    parser.add_argument("--streams", default="1,8,16")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--step-repeats", type=int, default=30, help="calls of each mode per timed step (0: none)")
    parser.add_argument("--quick", action="store_true", help="1 round, 16 new tokens, 1 and 8 streams")
    parser.add_argument("--out", type=Path, default=RESULTS / "argmax_rows")
    args = parser.parse_args(argv)
    if args.child:
        plan = json.loads(Path(args.child[0]).read_text())
        Path(args.child[1]).write_text(json.dumps(measure(plan)))
        return 0
    if args.quick:
        args.rounds, args.new_tokens, args.streams, args.step_repeats = 1, 16, "1,8", min(args.step_repeats, 4)
    from peers import convert_for_helexa, load_tokenizer, model_gguf, stream_prompts

    from helexa.model.quant import native

    streams = [int(s) for s in args.streams.split(",")]
    tokenizer = load_tokenizer()
    chat = stream_prompts(tokenizer, max(streams))
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    steps: dict[str, list[dict[str, Any]]] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            model_dir = convert_for_helexa(model_gguf(model, args.threads))
            runs[model] = {m: [] for m in MODES}
            for r in range(args.rounds):
                for mode in MODES if r % 2 == 0 else MODES[::-1]:
                    print(
                        f"{model}, round {r + 1}/{args.rounds}, {mode} ({time.perf_counter() - started:.0f}s)",
                        flush=True,
                    )
                    plan = {"mode": mode, "model_dir": model_dir, "chat": chat, "streams": streams,
                            "new_tokens": args.new_tokens, "threads": args.threads}  # fmt: skip
                    runs[model][mode].append(run_mode(plan, Path(tmp)))
            if args.step_repeats > 0:
                steps[model] = time_steps(model_dir, sorted({1, args.threads}), args.step_repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = report(runs, args, native.kernel_path(), steps)
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"runs": runs, "steps": steps}))
    plot(runs, args, args.out.with_suffix(".png"))
    print(text)
    print(f"wrote {args.out.with_suffix('.md')}, .png, .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
