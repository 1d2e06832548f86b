"""Tensor-parallel step overhead: the same steps at TP 1 and TP N (gloo on CPU, NCCL on CUDA), and where
the TP N step's time goes on rank 0: packing and broadcasting the step's inputs, the collectives of the
forward (each including the wait for the slowest rank), and the rest (this rank's share of the compute).
A bare all-reduce of one decode step's hidden state, timed in the same run, is the baseline per collective.

    python bench/tp_overhead.py                 # a 37M-parameter random Llama on CPU, TP 2 vs TP 1
    python bench/tp_overhead.py --tp 2 --device cuda --dtype bfloat16   # on a host with two GPUs
    python bench/tp_overhead.py --quick         # a smoke run (the tiny test model)

Writes `bench/out/tp_overhead.md`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helexa.config import EngineConfig  # noqa: E402
from helexa.engine.engine import Engine  # noqa: E402
from helexa.engine.parallel import step  # noqa: E402
from helexa.kvcache import BatchBuilder  # noqa: E402
from helexa.model.parallel import comm  # noqa: E402
from tests.support.models import build_tiny_tokenizer_dir, make_tiny_model  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"


def _model(root: Path, quick: bool) -> Path:
    shape = (
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=512)
        if quick
        else dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=12,
                  num_key_value_heads=4, head_dim=64, vocab_size=8192)
    )  # fmt: skip
    path = make_tiny_model(root, "llama", max_position_embeddings=2048, name="bench", **shape)
    build_tiny_tokenizer_dir(path)
    return path


class Timers:
    """Seconds spent per kind of call on rank 0, while `active`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1

        return timed


@contextmanager
def instrumented(timers: Timers) -> Iterator[None]:
    """Time the step broadcast (`StepChannel.send`) and the forward's collectives on rank 0."""
    saved = (step.StepChannel.send, comm.dist.all_reduce, comm.dist.gather)
    step.StepChannel.send = timers.wrap("broadcast step inputs", saved[0])  # type: ignore[method-assign]
    comm.dist.all_reduce = timers.wrap("all_reduce (o_proj, down, embed)", saved[1])  # type: ignore[assignment]
    comm.dist.gather = timers.wrap("gather logits to rank 0", saved[2])  # type: ignore[assignment]
    try:
        yield
    finally:
        step.StepChannel.send, comm.dist.all_reduce, comm.dist.gather = saved  # type: ignore[method-assign]


def _steps(engine: Engine, batch: list[int], repeats: int) -> list[float]:
    """Wall seconds of `repeats` forwards over fresh tables with `batch[i]` new tokens each (to the host)."""
    runner = engine.runner
    assert runner is not None
    times = []
    builder = BatchBuilder(runner.pool, len(batch), engine.max_model_len)  # scratch tables on the idle pool
    for _ in range(repeats + 1):  # the first is a warm-up
        tables = [builder.new_table() for _ in batch]
        try:
            times.append(runner._time_forward(builder, list(zip(tables, batch))))
        finally:
            for t in tables:
                runner.pool.decref(builder.release(t))
    return times[1:]


def _greedy(engine: Engine) -> list[list[int]]:
    """Greedy tokens of three fixed prompts, batched: the parity check between TP 1 and TP N."""
    from helexa.model.sampling import SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    handles = [engine.submit([3 + (11 * i + j) % 400 for j in range(20 + 9 * i)], params) for i in range(3)]
    done: dict[str, list[int]] = {h.request_id: [] for h in handles}
    finished: set[str] = set()
    while len(finished) < len(handles):
        engine.step()
        for h in handles:
            while (event := h.stream.get(timeout=0)) is not None:
                done[h.request_id].extend(event.token_ids)
                if event.finished:
                    finished.add(h.request_id)
    return [done[h.request_id] for h in handles]


def _bare_rank(rank: int, size: int, port: int, hidden: int, out: str, n: int = 50) -> None:
    """One rank of the baseline: `n` all-reduces of a decode step's hidden state (8 rows) in float32."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    x = torch.zeros(8, hidden)
    for _ in range(5):
        dist.all_reduce(x)
    start = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(x)
    if rank == 0:
        Path(out).write_text(str((time.perf_counter() - start) / n))
    dist.destroy_process_group()


def _bare_all_reduce(size: int, hidden: int) -> float:
    """Seconds per bare gloo all-reduce of (8, hidden) over `size` fresh processes (the collective's floor here)."""
    import torch.multiprocessing as mp

    from helexa.engine.parallel import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "seconds")
        mp.spawn(_bare_rank, args=(size, free_port(), hidden, out), nprocs=size)
        return float(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--tp1-threads", type=int, default=None,
        help="torch threads of the TP 1 run (default: torch's; TP N gives each rank cores / N on a CPU)",
    )  # fmt: skip
    args = parser.parse_args()
    shapes = {"decode 8 seqs": [1] * 8, "prefill 256 tokens": [256]}
    with tempfile.TemporaryDirectory() as tmp:
        path = _model(Path(tmp), args.quick)
        config = EngineConfig.of(model=str(path), device=args.device, dtype=args.dtype, attention_backend="auto",
                                 num_blocks=256, block_size=16, max_num_seqs=8, max_num_batched_tokens=256,
                                 step_timeout_secs=120.0)  # fmt: skip
        results: dict[tuple[int, str], list[float]] = {}
        breakdown: dict[str, tuple[dict[str, float], dict[str, int], float]] = {}
        params = 0
        greedy: dict[int, list[list[int]]] = {}
        threads = torch.get_num_threads()
        if args.tp1_threads:
            torch.set_num_threads(args.tp1_threads)
        tp1_threads = torch.get_num_threads()
        for size in (1, args.tp):
            engine = Engine(config.replace(tensor_parallel_size=size))
            try:
                runner = engine.runner
                assert runner is not None
                params = engine.model_config.num_parameters
                for name, batch in shapes.items():
                    timers = Timers()
                    with instrumented(timers):
                        times = _steps(engine, batch, args.repeats)
                    results[(size, name)] = times
                    if size > 1:
                        per_step = {k: v / (args.repeats + 1) for k, v in timers.seconds.items()}
                        calls = {k: v // (args.repeats + 1) for k, v in timers.calls.items()}
                        breakdown[name] = (per_step, calls, 0.0)
                greedy[size] = _greedy(engine)
            finally:
                engine.shutdown()
        if args.device == "cpu":  # the baseline, once the engines' processes are gone
            bare = _bare_all_reduce(args.tp, engine.model_config.hidden_size)
            breakdown = {k: (v[0], v[1], bare) for k, v in breakdown.items()}
    lines = [f"# Tensor-parallel step overhead: TP {args.tp} vs TP 1 on {args.device} ({args.dtype})", "",
             f"Random Llama, {params / 1e6:.1f}M parameters; median of {args.repeats} steps, each to its sampled "
             f"rows on the host. Torch threads: TP 1 {tp1_threads}; TP {args.tp} "
             f"{max(1, (torch.multiprocessing.cpu_count() // args.tp)) if args.device == 'cpu' else threads} per rank.",
             "",
             f"| step | TP 1 ms | TP {args.tp} ms | TP {args.tp} / TP 1 | TP 1 GFLOP/s | TP {args.tp} GFLOP/s |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for name, batch in shapes.items():
        one, many = statistics.median(results[(1, name)]), statistics.median(results[(args.tp, name)])
        flops = 2 * params * sum(batch)
        lines.append(f"| {name} | {one * 1e3:.2f} | {many * 1e3:.2f} | {many / one:.2f}x | {flops / one / 1e9:.1f} | "
                     f"{flops / many / 1e9:.1f} |")  # fmt: skip
    for name, (per_step, calls, bare) in breakdown.items():
        total = statistics.mean(results[(args.tp, name)])
        floor = f"; a bare all-reduce of 8 hidden rows in the same run: {bare * 1e3:.3f} ms" if bare else ""
        lines += ["", f"Where a TP {args.tp} `{name}` step goes on rank 0 (mean {total * 1e3:.2f} ms{floor}):", "",
                  "| part | calls/step | ms/step | share |", "|---|---|---|---|"]  # fmt: skip
        rest = total
        for part, seconds in per_step.items():
            rest -= seconds
            lines.append(f"| {part} | {calls[part]} | {seconds * 1e3:.2f} | {seconds / total:.0%} |")
        lines.append(f"| compute and the rest (this rank's shard, sampling rows to host) | | {rest * 1e3:.2f} | "
                     f"{rest / total:.0%} |")  # fmt: skip
    same = greedy[1] == greedy[args.tp]
    lines += ["", f"Greedy tokens of 3 prompts x 16, TP {args.tp} vs TP 1: {'identical' if same else 'DIFFERENT'}"]
    text = "\n".join(lines) + "\n"
    print(text)
    OUT.mkdir(exist_ok=True)
    (OUT / "tp_overhead.md").write_text(text)
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
