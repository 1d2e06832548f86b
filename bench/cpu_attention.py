"""The fused CPU step's paged attention alone, per instruction-set path, against torch and an older tree.

For each model shape (query heads / KV heads / head size: SmolLM2-135M 9/3/64, a 1B Llama 32/4/64, an
8B Llama 32/8/128), context length and number of sequences (`--sequences`, 1 by default), the sequences'
query rows over a float16 paged cache (blocks of 16, scattered over one pool) are attended by:

- `helexa`: this tree's kernel (`helexa_paged_attention`, what `native_step.paged_attention` calls) on
  every path this CPU runs;
- `baseline` (with `--baseline DIR`, a checkout of the code before, e.g.
  `git worktree add /tmp/base HEAD~1`): that tree's `csrc/` built with the same path's flags and
  called through the same C function, so the ratio is this tree's kernel against the older one's;
- `torch SDPA`: `scaled_dot_product_attention` (GQA) over the same keys and values already gathered
  into contiguous float32 tensors (its best case: the gathering is not timed), for one row (decode)
  only, where it has no mask to build.

Rows: 1 (a decode row) and 16 (a tile of prefill rows at the end of the context) for one sequence; one
decode row each for more (a batched decode step's attention). Each contender calls
`--layers` distinct caches in turn, as a model's layers are, so with the default 8 the K/V come from
memory as in a long context's decode (`--layers 1`: the same cache every call, K/V in cache). Every
result is checked bit for bit against the first path's and against the baseline's (both promise the
same bits) and against the float64 reference. The table also gives the rate at which the best path read
the K/V (every key of every sequence once). Each round times every contender back to back (10 calls
or more each), in an order shuffled per round (a fixed order made the contender after torch's SDPA, whose
float32 copies evict the caches, measure slower); the median over `--rounds` rounds counts.

    python bench/cpu_attention.py [--baseline /tmp/base] [--threads 2] [--rounds 9] [--layers 8]
    python bench/cpu_attention.py --models 135m,1b --contexts 128,1024 --sequences 16,64   # batched decode

Prints the CPU model and the paths; writes `bench/results/cpu_attention.md` and `.png` (`--out STEM`: `STEM.md`
and `STEM.png`).
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.machine import cpu_name  # noqa: E402
from helexa.kernels import reference  # noqa: E402
from helexa.model.quant import isa, native  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {"135m": (9, 3, 64), "1b": (32, 4, 64), "8b": (32, 8, 128)}
BLOCK = 16
CALLS = 10  # calls per timing


def inputs(
    shape: tuple[int, int, int], context: int, rows: int, seed: int = 0, sequences: int = 1
) -> tuple[torch.Tensor, ...]:
    """q (sequences x rows, H, D) for the last `rows` positions of each of `sequences` sequences of `context`
    tokens, whose float16 keys and values lie in blocks scattered over one pool: (q, k_cache, v_cache,
    tables, seq_lens, starts)."""
    heads, kv_heads, d = shape
    g = torch.Generator().manual_seed(seed)
    blocks = -(-context // BLOCK)
    pool = sequences * blocks + 1
    k_cache = torch.randn(pool, BLOCK, kv_heads, d, generator=g).half()
    v_cache = torch.randn(pool, BLOCK, kv_heads, d, generator=g).half()
    tables = torch.randperm(pool, generator=g)[: sequences * blocks].to(torch.int32).view(sequences, blocks)
    q = torch.randn(sequences * rows, heads, d, generator=g) * 2
    return (
        q,
        k_cache,
        v_cache,
        tables,
        torch.full((sequences,), context, dtype=torch.int32),
        torch.arange(0, sequences * rows + 1, rows, dtype=torch.int32),
    )


def baseline_library(tree: Path, path: isa.KernelPath) -> ctypes.CDLL:
    """`tree`'s kernel sources built with `path`'s flags and loaded (`native.load_path` with its `csrc`, as helexa
    builds its own); SystemExit with the reason when that fails."""
    lib, why = native.load_path(path, csrc=tree / "helexa" / "model" / "quant" / "csrc")
    if lib is None:
        raise SystemExit(f"the kernels of {tree} do not load: {why}")
    return lib


def call_library(lib: ctypes.CDLL, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """`lib`'s helexa_paged_attention on `args` (as `native_step.paged_attention` calls it), into a
    NaN-poisoned output."""
    q, k, v, tables, lens, starts = args
    out = torch.full_like(q, float("nan"))
    rc = lib.helexa_paged_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), *k.stride()[:3], BLOCK, tables.shape[0], q.shape[1], k.shape[2],
        q.shape[2],
        starts.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(), q.shape[2] ** -0.5, 1,
        out.data_ptr(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"helexa_paged_attention returned {rc}")
    return out


def sdpa_call(args: tuple[torch.Tensor, ...]) -> Callable[[], torch.Tensor]:
    """torch's attention of each sequence's one query row over the same keys and values, gathered contiguous
    first (every sequence is as long: one batched call)."""
    q, k_cache, v_cache, tables, lens, _ = args
    n = int(lens[0])
    k = k_cache[tables.long()].flatten(1, 2)[:, :n].float().transpose(1, 2)  # (S, KVH, n, D)
    v = v_cache[tables.long()].flatten(1, 2)[:, :n].float().transpose(1, 2)
    qt = q[:, :, None]  # (S, H, 1, D)
    return lambda: F.scaled_dot_product_attention(qt, k, v, enable_gqa=True)[:, :, 0]


def timed(fns: list[Callable[[], object]]) -> float:
    """ms per call, calling each of `fns` in turn (one per layer's cache) until CALLS calls or more."""
    passes = -(-CALLS // len(fns))
    t0 = time.perf_counter()
    for _ in range(passes):
        for fn in fns:
            fn()
    return (time.perf_counter() - t0) / (passes * len(fns)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="a checkout of older code: its kernel is built and timed too")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--contexts", default="1024,4096,8128")
    parser.add_argument("--models", default="135m,1b,8b")
    parser.add_argument(
        "--sequences",
        default="1",
        help="sequences per call, each of every context length (more than 1: one decode row each, as a "
        "batched decode step's attention)",
    )
    parser.add_argument(
        "--out", type=Path, default=RESULTS / "cpu_attention", help="where to write STEM.md and STEM.png"
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=8,
        help="distinct caches called in turn, as a model's layers are (then K/V come from memory, as in a "
        "long context's decode); 1: the same cache every call (K/V stay in cache)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    paths = [name for name, p in isa.PATHS.items() if not isa.missing(p) and native.load_path(p)[0] is not None]
    if not paths:
        sys.exit(f"no kernel path runs here: {native.unavailable_reason()}")
    libraries = {name: native.load_path(isa.PATHS[name])[0] for name in paths}
    baselines = {name: baseline_library(args.baseline, isa.PATHS[name]) for name in paths} if args.baseline else {}
    for lib in [*libraries.values(), *baselines.values()]:
        lib.helexa_set_threads(args.threads)
    print(f"CPU: {cpu_name()}; kernel paths run: {', '.join(paths)}; {args.threads} threads", flush=True)

    rows_out: list[dict] = []
    for model in args.models.split(","):
        for context, sequences in itertools.product(map(int, args.contexts.split(",")), _ints(args.sequences)):
            for rows in (1, 16) if sequences == 1 else (1,):
                cases = [inputs(SHAPES[model], context, rows, seed, sequences) for seed in range(args.layers)]
                case = cases[0]
                want = reference.paged_attention(*(t.double() if t.is_floating_point() else t for t in case))
                contenders: dict[str, list[Callable[[], torch.Tensor]]] = {}
                for name in paths:
                    contenders[f"helexa {name}"] = [lambda n=name, c=c: call_library(libraries[n], c) for c in cases]
                    if name in baselines:
                        contenders[f"baseline {name}"] = [
                            lambda n=name, c=c: call_library(baselines[n], c) for c in cases
                        ]
                if rows == 1:
                    contenders["torch SDPA"] = [sdpa_call(c) for c in cases]
                outs = {k: fns[0]() for k, fns in contenders.items()}
                first = outs[f"helexa {paths[0]}"]
                torch.testing.assert_close(first, want.float(), rtol=1e-4, atol=1e-4)
                same = all(torch.equal(o, first) for k, o in outs.items() if k != "torch SDPA")
                times: dict[str, list[float]] = {k: [] for k in contenders}
                order = random.Random(f"{model} {context} {rows}")
                for _ in range(args.rounds):  # in a shuffled order each round: none always follows the same one
                    for k in order.sample(list(contenders), len(contenders)):
                        times[k].append(timed(contenders[k]))
                ms = {k: statistics.median(v) for k, v in times.items()}
                case_of = {"model": model, "context": context, "sequences": sequences, "rows": rows}
                rows_out.append({**case_of, "ms": ms, "same_bits": same})
                print(
                    f"{model} {sequences:>3} x {context:>5} keys x {rows:>2} rows: "
                    + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items())
                    + ("" if same else "  (NOT the same bits)"),
                    flush=True,
                )
    _write(rows_out, paths, baselines, args)


def _ints(text: str) -> list[int]:
    """The positive integers of a comma-separated list; SystemExit naming the bad item."""
    values = []
    for item in text.split(","):
        if not item.strip().isdigit() or int(item) < 1:
            raise SystemExit(f"--sequences takes positive integers separated by commas, got {item!r}")
        values.append(int(item))
    return values


def kv_bytes(model: str, sequences: int, context: int) -> int:
    """Bytes of float16 K and V a call reads: every key of every sequence, every KV head."""
    _, kvh, d = SHAPES[model]
    return 2 * sequences * context * kvh * d * 2


def _commit(tree: Path) -> str:
    """`tree`'s checked-out commit, or "not a git checkout"."""
    result = subprocess.run(["git", "-C", str(tree), "log", "-1", "--format=%h %s"], capture_output=True, text=True)
    return result.stdout.strip()[:80] if result.returncode == 0 else "not a git checkout"


def _write(rows: list[dict], paths: list[str], baselines: dict, args: argparse.Namespace) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    names = list(rows[0]["ms"])
    head = [
        "# The fused CPU step's paged attention alone (bench/cpu_attention.py)",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M')}; CPU: {cpu_name()}; kernel paths: {', '.join(paths)}; "
        f"{args.threads} threads; float16 cache, blocks of {BLOCK}; {args.layers} caches (layers) called in turn; "
        f"median of {args.rounds} rounds of {CALLS} calls or more, the contenders in a shuffled order each round"
        + (f"; baseline: {args.baseline} ({_commit(args.baseline)})" if baselines else ""),
        "",
        "| model (H / KVH / D) | sequences | keys | rows | "
        + " | ".join(f"{n} (ms)" for n in names)
        + f" | K/V read, helexa {paths[-1]} (GB/s) | ratios | same bits |",
        "|---|---|---|---|" + "---|" * len(names) + "---|---|---|",
    ]
    for r in rows:
        h, kvh, d = SHAPES[r["model"]]
        ms = r["ms"]
        ratios = []
        for p in paths:
            if f"baseline {p}" in ms:
                ratios.append(f"{p} vs baseline {ms[f'baseline {p}'] / ms[f'helexa {p}']:.2f}x")
            if "torch SDPA" in ms:
                ratios.append(f"{p} vs SDPA {ms['torch SDPA'] / ms[f'helexa {p}']:.2f}x")
        cells = [f"{ms[n]:.3f}" if n in ms else "—" for n in names]
        rate = kv_bytes(r["model"], r["sequences"], r["context"]) / (ms[f"helexa {paths[-1]}"] * 1e6)
        head.append(
            f"| {r['model']} ({h} / {kvh} / {d}) | {r['sequences']} | {r['context']} | {r['rows']} | "
            + " | ".join(cells)
            + f" | {rate:.1f} | {'; '.join(ratios)} | {'yes' if r['same_bits'] else 'NO'} |"
        )
    args.out.with_suffix(".md").write_text("\n".join(head) + "\n")
    print("\n".join(head))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.8))
    labels = [f"{r['model']} {r['sequences']}x{r['context']}x{r['rows']}" for r in rows]
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        ax.bar([j + i * width for j in range(len(rows))], [r["ms"].get(n, 0.0) for r in rows], width=width, label=n)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], labels, fontsize=7, rotation=30)
    ax.set_ylabel("ms per call (lower is better)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title(f"paged attention, {cpu_name()}, {args.threads} threads", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
