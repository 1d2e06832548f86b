"""Admission accuracy and policies: every queued request's predicted start against its actual start, and the
same realistic workload under `reserve` and `adaptive`.

The workload, the same for every policy (seeded):

1. the incident's burst: 50 chat requests at once, none with max_tokens (each reserves the 4,096-token
   default under `reserve`: 13 fit a 3,428-block pool at a time);
2. then a stream of requests arriving at random (Poisson) with a mix of limits — none, 64 and 512
   tokens — so some answers end by themselves and some are cut at `max_tokens`.

Answers are sampled at temperature 1 and end when the model says so: their lengths are long-tailed
and unknown to admission. For each request that had to wait, the table compares the wait admission
predicted at arrival with the wait it had, and beside it the prediction the worst-case planner (every
answer runs to its `max_tokens`) would have made at the same instant — the baseline, measured in the
same run. Policies are compared on throughput, time to first token, preemptions and recomputed tokens.

    python bench/admission_accuracy.py                    # the tiny chat model (built under bench/out)
    python bench/admission_accuracy.py --model default    # SmolLM2-135M-Instruct (slow on CPU)
    python bench/admission_accuracy.py --quick            # a smoke run

Writes `bench/out/admission_accuracy[_MODEL][_BLOCKS].md` and `.png`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helexa.admission import AdmissionRejected  # noqa: E402
from helexa.config import EngineConfig  # noqa: E402
from helexa.engine.engine import Engine  # noqa: E402
from helexa.engine.interface import RequestHandle  # noqa: E402
from helexa.model.sampling import SamplingParams  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
_TOPICS = (
    "the cache",
    "a queue of agents",
    "paged attention",
    "the scheduler",
    "block tables",
    "a long tool call",
    "the tokenizer",
    "prefix sharing",
)
_ASKS = ("Tell me about {}.", "Explain {} in one sentence.", "Write a short story about {}.", "List facts on {}.")


@dataclass
class Outcome:
    """One request's life as the benchmark saw it (monotonic seconds)."""

    phase: str
    arrival: float
    max_tokens: int | None
    predicted_wait: float | None = None  # what admission said at arrival (None: granted at once)
    worst_case_wait: float | None = None  # what the worst-case planner would have said at the same instant
    actual_wait: float | None = None
    first_token: float | None = None
    tokens: int = 0
    finish: str | None = None
    rejected: str | None = None
    handle: RequestHandle | None = field(default=None, repr=False)


def _model_dir(name: str) -> str:
    if name == "default":
        return "smollm2-135m-instruct"
    from tests.support.servers import make_tiny_model_dir  # transformers (the test extra) builds it

    path = OUT / "tiny-chat-model"
    if not (path / "tiny-chat" / "config.json").exists():
        make_tiny_model_dir(path, max_position_embeddings=8192)
    return str(path / "tiny-chat")


def _prompt(engine: Engine, rng: random.Random) -> list[int]:
    content = rng.choice(_ASKS).format(rng.choice(_TOPICS))
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


def _workload(n_burst: int, n_stream: int, rate: float, seed: int) -> list[tuple[str, float, int | None]]:
    """(phase, arrival offset in seconds, max_tokens) for every request, the same for every policy."""
    rng = random.Random(seed)
    requests: list[tuple[str, float, int | None]] = [("burst", 0.0, None)] * n_burst
    t = 0.0
    for _ in range(n_stream):
        t += rng.expovariate(rate)
        requests.append(("stream", t, rng.choice([None, None, 64, 512])))
    return requests


def _read(outcome: Outcome) -> None:
    """Read one request's stream to its end (blocking, so a waiting request costs the engine nothing)."""
    assert outcome.handle is not None
    for event in outcome.handle.stream:
        if event.token_ids and outcome.first_token is None:
            outcome.first_token = time.monotonic()
        outcome.tokens += len(event.token_ids)
        if event.finished:
            outcome.finish = event.finish_reason if event.error is None else f"error: {event.error}"
            return


def run_policy(model: str, policy: str, workload, seed: int, dtype: str, num_blocks: int) -> tuple[list[Outcome], dict]:
    """Serve the workload on a fresh engine under `policy`; every request's outcome and the engine's totals."""
    config = EngineConfig.of(
        model=model,
        device="cpu",
        dtype=dtype,
        attention_backend="torch",
        num_blocks=num_blocks,
        block_size=16,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        default_max_tokens=4096,
        max_wait_secs=600.0,
        policy=policy,
        seed=seed,
    )
    engine = Engine(config)
    engine.start()
    rng = random.Random(seed)
    outcomes: list[Outcome] = []
    start = time.monotonic()
    try:
        for i, (phase, offset, max_tokens) in enumerate(tqdm(workload, desc=f"{policy}: submit", leave=False)):
            delay = start + offset - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            prompt = _prompt(engine, rng)
            params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed * 100_003 + i)
            outcome = Outcome(phase, time.monotonic(), max_tokens)
            try:
                outcome.worst_case_wait = engine.admission.estimate_wait(len(prompt), max_tokens, worst_case=True)
                outcome.handle = engine.submit(prompt, params)
            except AdmissionRejected as exc:
                outcome.rejected = exc.reason
                outcomes.append(outcome)
                continue
            ticket = outcome.handle.ticket
            outcome.arrival = ticket.arrival
            if ticket.est_wait_at_arrival > 0 or ticket.granted_at is None:
                outcome.predicted_wait = ticket.est_wait_at_arrival
            outcomes.append(outcome)
            threading.Thread(target=_read, args=(outcome,), daemon=True).start()
        with tqdm(total=len(outcomes), desc=f"{policy}: finished", leave=False) as bar:
            while True:
                done = sum(o.finish is not None or o.rejected is not None for o in outcomes)
                bar.update(done - bar.n)
                if done == len(outcomes):
                    break
                time.sleep(0.05)
        wall = time.monotonic() - start
    finally:
        engine.shutdown(0.0)
    for o in outcomes:
        if o.handle is not None and o.handle.ticket.granted_at is not None:
            o.actual_wait = o.handle.ticket.granted_at - o.arrival
    snap = engine.snapshot()
    totals = {
        "wall": wall,
        "tokens": sum(o.tokens for o in outcomes),
        "preemptions": engine.counters.preemptions,
        "recomputed": engine.counters.recomputed_tokens,
        "kv_timeout": snap["rejected"]["kv_timeout"],
        "rejected": sum(snap["rejected"].values()),
        "length_samples": snap["answer_length_samples"],
        "decode_step_ms": snap["decode_step_seconds"] * 1e3,
    }
    return outcomes, totals


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")


def accuracy(outcomes: list[Outcome], min_wait: float) -> dict[str, float]:
    """Actual / predicted wait over requests that waited; the worst-case planner's ratio beside it."""
    waited = [o for o in outcomes if o.predicted_wait and o.actual_wait is not None and o.predicted_wait >= min_wait]
    ratios = [o.actual_wait / o.predicted_wait for o in waited]  # type: ignore[operator]
    worst = [o.actual_wait / o.worst_case_wait for o in waited if o.worst_case_wait]  # type: ignore[operator]
    within = sum(0.5 <= r <= 2.0 for r in ratios) / len(ratios) if ratios else float("nan")
    return {
        "n": len(ratios),
        "median": statistics.median(ratios) if ratios else float("nan"),
        "within_2x": within,
        "p10": pct(ratios, 0.1),
        "p90": pct(ratios, 0.9),
        "worst_median": statistics.median(worst) if worst else float("nan"),
        "worst_within_2x": sum(0.5 <= r <= 2.0 for r in worst) / len(worst) if worst else float("nan"),
    }


def _ttft(outcomes: list[Outcome]) -> list[float]:
    return [o.first_token - o.arrival for o in outcomes if o.first_token is not None]


def report(results: dict[str, tuple[list[Outcome], dict]], args) -> str:
    lines = [
        f"# Admission accuracy and policies ({args.model} model, {args.dtype}, {time.strftime('%Y-%m-%d')})",
        "",
        f"Workload: {args.burst} requests at once without max_tokens, then {args.stream} Poisson arrivals at "
        f"{args.rate}/s (max_tokens none / 64 / 512); temperature 1; pool {args.num_blocks:,} blocks of 16; "
        "64 sequences.",
        f"Ratio = actual wait / predicted wait, for requests that waited >= {args.min_wait} s (predicted).",
        "",
        "| policy | waited | median ratio | within 0.5-2x | p10-p90 | worst-case planner: median, within 2x |"
        " burst kv_timeout | all rejected |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for policy, (outcomes, totals) in results.items():
        a = accuracy(outcomes, args.min_wait)
        burst_timeouts = sum(o.rejected == "kv_timeout" for o in outcomes if o.phase == "burst")
        lines.append(
            f"| {policy} | {a['n']} | {a['median']:.2f} | {a['within_2x']:.0%} | {a['p10']:.2f}-{a['p90']:.2f} | "
            f"{a['worst_median']:.3f}, {a['worst_within_2x']:.0%} | {burst_timeouts} | {totals['rejected']} |"
        )
    lines += [
        "",
        "| policy | output tok/s | vs reserve | TTFT p50 | TTFT p99 | preemptions | recomputed tokens | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = results["reserve"][1]["tokens"] / results["reserve"][1]["wall"] if "reserve" in results else None
    for policy, (outcomes, totals) in results.items():
        tps = totals["tokens"] / totals["wall"]
        ttft = _ttft(outcomes)
        ratio = f"{tps / base:.2f}x" if base else "-"
        lines.append(
            f"| {policy} | {tps:.1f} | {ratio} | {pct(ttft, 0.5):.2f} s | {pct(ttft, 0.99):.2f} s | "
            f"{totals['preemptions']} | {totals['recomputed']} | {totals['wall']:.1f} |"
        )
    lengths = sorted(o.tokens for o in results[next(iter(results))][0] if o.finish)
    cut = sum(o.finish == "length" for o in results[next(iter(results))][0])
    lines += [
        "",
        f"Answer lengths (first policy): median {pct(lengths, 0.5):.0f}, p90 {pct(lengths, 0.9):.0f}, "
        f"max {max(lengths) if lengths else 0}; {cut} cut at max_tokens.",
    ]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, tuple[list[Outcome], dict]], min_wait: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for policy, (outcomes, _) in results.items():
        waited = [
            o for o in outcomes if o.predicted_wait and o.actual_wait is not None and o.predicted_wait >= min_wait
        ]
        axes[0].scatter([o.predicted_wait for o in waited], [o.actual_wait for o in waited], s=10, label=policy)
        if policy == "reserve":
            axes[0].scatter(
                [o.worst_case_wait for o in waited], [o.actual_wait for o in waited], s=6, marker="x",
                label="worst-case planner (same requests)",
            )  # fmt: skip
        ttft = sorted(_ttft(outcomes))
        axes[1].plot(ttft, [i / max(1, len(ttft) - 1) for i in range(len(ttft))], label=policy)
    lim = max([1.0] + [o.actual_wait or 0 for r in results.values() for o in r[0]])
    axes[0].plot([0, lim], [0, lim], "k--", lw=0.8)
    axes[0].plot([0, lim], [0, 2 * lim], "k:", lw=0.6)
    axes[0].plot([0, 2 * lim], [0, lim], "k:", lw=0.6)
    axes[0].set(xscale="log", yscale="log", xlabel="predicted wait at arrival (s)", ylabel="actual wait (s)")
    axes[0].set_title("predicted vs actual start")
    axes[0].legend(fontsize=8)
    axes[1].set(xlabel="time to first token (s)", ylabel="fraction of requests", title="TTFT")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny", "default"], default="tiny")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--burst", type=int, default=50)
    parser.add_argument("--stream", type=int, default=250)
    parser.add_argument("--rate", type=float, default=None, help="arrivals per second (default: by model)")
    parser.add_argument("--policies", default="reserve,adaptive")
    parser.add_argument("--min-wait", type=float, default=0.05)
    parser.add_argument("--num-blocks", type=int, default=3428, help="KV pool (the incident's node: 3,428)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.burst, args.stream = 12, 20
    if args.rate is None:
        args.rate = 25.0 if args.model == "tiny" else 1.0
    if args.threads:
        torch.set_num_threads(args.threads)
    OUT.mkdir(exist_ok=True)
    model = _model_dir(args.model)
    workload = _workload(args.burst, args.stream, args.rate, args.seed)
    results = {}
    for policy in args.policies.split(","):
        results[policy] = run_policy(model, policy, workload, args.seed, args.dtype, args.num_blocks)
    text = report(results, args)
    print(text)
    name = "admission_accuracy" + ("" if args.model == "tiny" else f"_{args.model}")
    name += "" if args.num_blocks == 3428 else f"_{args.num_blocks}"
    (OUT / f"{name}.md").write_text(text)
    plot(results, args.min_wait, OUT / f"{name}.png")
    print(f"wrote {OUT / name}.md and .png")


if __name__ == "__main__":
    main()
