"""Host work per engine step: everything a step does besides the model's forward (admission, scheduling,
speculative drafts, the KV tables, packing the inputs, sampling the rows to the host, detokenising, stop
strings, streaming the events), by part, at 1, 16 and 64 decoding sequences, with speculative decoding off
and on (the default).

On a GPU this is the time the device waits for the host between two CUDA-graph replays; the issue's bar is
under 1 ms a step at 64 sequences. The model's compute is timed and subtracted: the forward, or, for a model
on the fused CPU step, the native calls alone (so the Python around them, the lookup and the head's wrappers
where a tree has them outside the call, counts as host work: the "forward's Python" column). Two models:

- `tiny` (the default): the test suite's tiny Llama (vocabulary 512). Its forward leaves the host's caches
  alone and its sampling costs little, as on a GPU host, where both run on the device.
- the default model (`--model smollm2-135m-instruct`): CPU serving. Its forward streams ~90 MB of weights
  through the caches the host work then runs in, and sampling 49,152 columns on the CPU counts as host.

    python bench/host_step.py                        # the tiny model, this tree
    python bench/host_step.py --baseline HEAD~3      # and another commit's tree, in alternation, same run
    python bench/host_step.py --model smollm2-135m-instruct
    python bench/host_step.py --quick                # fewer steps and rounds (a smoke run)
    python bench/host_step.py --model smollm2-135m-instruct --sampling penalties   # how every row samples

The requests are served through the engine core process's own code (`CoreServer`, on a socket pair in this
process): its event loop, on another thread, reads every stream and writes the events as frames while the
engine steps, as when serving (`--consumer loop`: a bare loop reads them; `--consumer none`: nobody does).

Writes `bench/out/host_step.md` and `bench/out/host_step.png` (`host_step_<sampling>.*` for another sampling).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from trees import alternate, run_worker  # noqa: E402

OUT = ROOT / "bench" / "out"
SEQS = (1, 16, 64)
MODES = ("off", "default")
# The parts timed inside a step; "other" is the rest of the step's host work (admission, scheduling, the
# prefix cache's offers, the step's bookkeeping).
# The native library's calls that are a fused CPU step's compute (this tree's, and older trees' names).
NATIVE_COMPUTE = ("helexa_forward", "helexa_step", "helexa_int4_gemm", "helexa_int8_gemm", "helexa_dense_head")
PARTS = {
    "drafts": ("engine", "_propose_drafts"),
    "kv tables": ("kv", "build_step"),
    "pack inputs": ("runner", "prepare"),
    "sample to host": ("runner", "_sample_rows"),
    "events": ("engine", "_postprocess"),
}
# How every sequence samples (`--sampling`): SamplingParams besides max_tokens and ignore_eos.
SAMPLING: dict[str, dict[str, object]] = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 1.0},
    "top-p": {"temperature": 0.7, "top_p": 0.9},
    "penalties": {"temperature": 0.0, "frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.1},
    "logprobs": {"temperature": 0.0, "logprobs": 5},
}


class _Consumers:
    """An asyncio loop on its own thread that reads every request's stream, each event made plain as for a frame
    (`--consumer loop`: the tables of 2026-12-06 before `--consumer core`, which runs the core's own code)."""

    def __init__(self, engine: object) -> None:
        import asyncio
        import threading

        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.pumps: list = []

    def submit(self, prompt: list[int], params: object) -> None:
        import asyncio

        try:
            from helexa.engine.core.wire import to_plain
        except ImportError:  # a tree from before the engine core process
            to_plain = repr
        stream = self.engine.submit(prompt, params).stream  # type: ignore[attr-defined]

        async def pump() -> None:
            async for event in stream:
                to_plain(event)

        self.pumps.append(asyncio.run_coroutine_threadsafe(pump(), self.loop))

    def close(self) -> None:
        self.engine.shutdown()  # type: ignore[attr-defined]
        for pump in self.pumps:
            pump.result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()


class _Core:
    """The engine core process's own serving code (`CoreServer`) in this process, on one end of a socket pair
    (`--consumer core`): requests are submitted by call frames, and its event loop, on its own thread, reads
    every stream and writes the events to the channel as frames, as it does when serving. A thread reads the
    other end and drops the bytes unparsed (the server's process does that work when serving). Calls go out
    with id 0 (no reply) but `shutdown`, whose reply is the last frame."""

    _ENDS: list = []  # ends kept open until this process exits: a baseline tree's core reader ended it on EOF

    def __init__(self, engine: object) -> None:
        import socket
        import threading

        from helexa.engine.core.process import CoreServer

        self.engine = engine
        near, self.far = socket.socketpair()
        self._ENDS.append((near, self.far))
        self.server = CoreServer(engine, near)  # type: ignore[arg-type]
        self.thread = threading.Thread(target=self.server.serve, daemon=True)
        self.thread.start()
        self.drain = threading.Thread(target=self._drop, daemon=True)
        self.drain.start()
        self.submitted = 0

    def _drop(self) -> None:
        buffer = bytearray(1 << 20)  # read into one buffer: no object made per read
        try:
            while self.far.recv_into(buffer):
                pass
        except OSError:
            pass

    def _call(self, method: str, *args: object) -> None:
        from helexa.engine.core.wire import write_frame

        write_frame(self.far, ("call", 0, method, list(args)))

    def submit(self, prompt: list[int], params: object) -> None:
        from helexa.engine.core.wire import to_plain

        self.submitted += 1
        self._call("submit", prompt, to_plain(params), f"bench-{self.submitted}", None, None)
        deadline = time.monotonic() + 30
        while len(self.engine._pending) < self.submitted:  # type: ignore[attr-defined]  # admitted in the core's thread
            if time.monotonic() > deadline:
                raise SystemExit("the core did not take a submitted request within 30 s")
            time.sleep(0.001)

    def close(self) -> None:
        """Shut the engine down through the core (every stream's last events go out), and its loop with it."""
        self._call("shutdown", 0.0)
        self.thread.join(timeout=30)


def _measure(
    model: str,
    seqs: int,
    mode: str,
    steps: int,
    sampling: str = "greedy",
    consumer: str = "core",
    **engine_args: object,
) -> dict[str, float]:
    """Medians over `steps` decode steps of `seqs` sequences (after a warm-up), in ms: of the whole step, of the
    forward, of each part, and of the host work (step minus forward). `consumer`: "core" serves the requests
    through the engine core process's own code (`_Core`), which reads every stream as serving does; "loop" reads
    them on a bare asyncio loop (`_Consumers`); "none" leaves the events in their streams. (Medians: the
    machine's other tenants add outliers.)"""
    import torch

    from helexa.config import EngineConfig
    from helexa.engine.engine import Engine
    from helexa.model.sampling import SamplingParams

    threads = torch.get_num_threads()  # put back, with the library below, when this measurement ends
    torch.set_num_threads(1)  # the host's own thread; the forward's threads do not matter here
    overrides = {} if mode == "default" else {"speculative": mode}
    config = EngineConfig.of(model=model, device="cpu", max_num_seqs=64, block_size=16, num_blocks=4096,
                             max_num_batched_tokens=4096, **overrides, **engine_args)  # fmt: skip
    engine = Engine(config)
    consumers = {"core": _Core, "loop": _Consumers}[consumer](engine) if consumer != "none" else None
    try:
        seconds: dict[str, float] = defaultdict(float)
        timing = [False]

        def timed(name: str, fn: Callable) -> Callable:
            def run(*args, **kwargs):
                if not timing[0]:
                    return fn(*args, **kwargs)
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    seconds[name] += time.perf_counter() - start

            return run

        owners = {"engine": engine, "kv": engine.kv, "runner": engine.runner}
        for name, (owner, attr) in {**PARTS, "forward": ("runner", "_forward")}.items():
            setattr(owners[owner], attr, timed(name, getattr(owners[owner], attr)))
        fused = getattr(engine.runner.model, "native_step", None) is not None
        from helexa.model.quant import native

        library = native.library  # put back when this measurement ends
        if fused:  # the model's compute is the native library's calls (a baseline tree's names too)

            class Timed:
                def __init__(self, lib: object) -> None:
                    self._lib = lib

                def __getattr__(self, name: str) -> Callable:
                    fn = getattr(self._lib, name)
                    return timed("native", fn) if name in NATIVE_COMPUTE else fn

            native.library = lambda: Timed(library())  # type: ignore[assignment]
        rng = random.Random(seqs)
        # Prompts that repeat a phrase: the drafter finds drafts in them, as in agent traffic that quotes.
        vocab = engine.runner.sample_vocab_size or 400
        phrase = [rng.randrange(3, min(vocab, 4000)) for _ in range(12)]
        prompt_len = 20 + 3 * len(phrase) + 1
        # Room for every step to keep a whole draft, within the context and 64 reservations of the pool.
        max_tokens = min(10 * steps + 40, engine.max_model_len - prompt_len - 1, 4096 // seqs * 16 - prompt_len - 16)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **SAMPLING[sampling])  # type: ignore[arg-type]
        for i in range(seqs):
            prompt = [rng.randrange(3, min(vocab, 4000)) for _ in range(20)] + phrase * 3 + [i + 3]
            if consumers is not None:
                consumers.submit(prompt, params)
            else:
                engine.submit(prompt, params)
        while any(s.in_prefill for s in engine._running) or len(engine._running) < seqs:
            engine.step()
        for _ in range(8):
            engine.step()
        timing[0] = True
        per_step: dict[str, list[float]] = defaultdict(list)
        for _ in range(steps):
            seconds.clear()
            start = time.perf_counter()
            engine.step()
            per_step["step"].append(time.perf_counter() - start)
            model = seconds["native"] if fused else seconds["forward"]
            per_step["host"].append(per_step["step"][-1] - model)
            per_step["forward python"].append(seconds["forward"] - model)
            for name in [*PARTS, "forward"]:
                per_step[name].append(seconds[name])
            parts = per_step["forward python"][-1] + sum(seconds[name] for name in PARTS)
            per_step["other"].append(per_step["host"][-1] - parts)
        if len(engine._running) < seqs:
            raise SystemExit(f"{seqs - len(engine._running)} of {seqs} sequences ended during the timed steps")
        return {name: statistics.median(values) * 1e3 for name, values in per_step.items()}
    finally:
        native.library = library  # type: ignore[method-assign]
        torch.set_num_threads(threads)
        if consumers is not None:
            consumers.close()  # the engine's shutdown, then every stream's last event read
        else:
            engine.shutdown()


def _worker(args: argparse.Namespace) -> None:
    """One tree's measurements, as JSON on stdout (run in the tree's own interpreter path)."""
    import helexa

    results = {
        f"{mode}/{n}": _measure(args.model, n, mode, args.steps, args.sampling, args.consumer)
        for mode in MODES
        for n in SEQS
    }
    print("RESULT " + json.dumps({"helexa": helexa.__file__, "results": results}))


def _run_tree(tree: Path, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    argv = ["--model", args.model, "--steps", str(args.steps), "--sampling", args.sampling, "--consumer", args.consumer]
    return run_worker(tree, ROOT / "bench" / "host_step.py", argv)["results"]


def _tiny_model(root: Path) -> str:
    """The test suite's tiny Llama (vocabulary 512, a trained tokenizer), with a 2,048-token context: room for
    every sequence's drafts through the timed steps."""
    sys.path.insert(0, str(ROOT))
    from tests.support.models import build_tiny_tokenizer_dir, make_tiny_model

    path = make_tiny_model(root, "llama", vocab_size=512, max_position_embeddings=2048, name="model")
    build_tiny_tokenizer_dir(path)
    return str(path)


def _median_runs(runs: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {case: {k: statistics.median(r[case][k] for r in runs) for k in runs[0][case]} for case in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="tiny (the test model), or a model name or directory")
    parser.add_argument("--steps", type=int, help="timed decode steps per case (default 60; --quick 30)")
    parser.add_argument("--rounds", type=int, help="runs per tree, alternating; the median (default 3; --quick 2)")
    parser.add_argument("--baseline", help="a commit to measure in the same run (a temporary git worktree)")
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds (a smoke run)")
    parser.add_argument("--sampling", choices=SAMPLING, default="greedy", help="how every sequence samples")
    parser.add_argument("--consumer", choices=("core", "loop", "none"), default="core",
                        help="core (default): the requests served by the engine core's own code on a socket "
                        "pair, its loop reading every stream and writing frames, as when serving; loop: every "
                        "stream read on a bare asyncio loop in another thread (the tables of 2026-12-06); none: "
                        "the events left in their streams (the tables before)")  # fmt: skip
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        label = args.model
        if args.model == "tiny":
            args.model = _tiny_model(Path(tmp) / "model")
        args.steps = args.steps or (30 if args.quick else 60)
        args.rounds = args.rounds or (2 if args.quick else 3)
        runs = alternate(args.baseline, args.rounds, lambda tree: _run_tree(tree, args))
    results = {name: _median_runs(r) for name, r in runs.items()}
    args.model = label
    _report(results, args)


def _report(results: dict[str, dict[str, dict[str, float]]], args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    from bench.machine import cpu_name

    names = list(results)
    mine = results[names[-1]]
    model = "the tiny test model (vocabulary 512)" if args.model == "tiny" else args.model
    alternation = ", trees run in alternation" if len(names) > 1 else ""
    lines = [
        "# Host work per engine step (step minus the model's compute), ms",
        "",
        f"CPU: {cpu_name()}, {os.cpu_count()} logical CPUs; model {model}; {args.steps} decode steps per case "
        f"after prefill and 8 warm-up steps, sampling {args.sampling} ({_sampling_text(args.sampling)}), "
        f"1 torch thread; {_CONSUMER_TEXT[args.consumer]}; each a median over the steps, then over "
        f"{args.rounds} round(s) per tree{alternation}. The bar: < 1 ms at 64 sequences.",
        "",
        "| speculative | sequences | " + " | ".join(f"host ms ({n})" for n in names)
        + (" | ratio |" if len(names) > 1 else " |") + " forward ms | forward's Python | " + " | ".join(PARTS)
        + " | other |",
        "|---|---:|" + "---:|" * (len(names) + (len(names) > 1) + 2 + len(PARTS) + 1),
    ]  # fmt: skip
    for case, row in mine.items():
        mode, n = case.split("/")
        hosts = [results[name][case]["host"] for name in names]
        ratio = f" {hosts[0] / hosts[-1]:.2f}x |" if len(names) > 1 else ""
        parts = " | ".join(f"{row.get(p, 0.0):.3f}" for p in PARTS)
        python = row.get("forward python", 0.0)
        lines.append(f"| {mode} | {n} | " + " | ".join(f"{h:.3f}" for h in hosts) + f" |{ratio} "
                     f"{row['forward']:.2f} | {python:.3f} | {parts} | {row['other']:.3f} |")  # fmt: skip
    text = "\n".join(lines) + "\n"
    print(text)
    OUT.mkdir(exist_ok=True)
    stem = "host_step" if args.sampling == "greedy" else f"host_step_{args.sampling}"
    (OUT / f"{stem}.md").write_text(text)
    _plot(results, OUT / f"{stem}.png")


_CONSUMER_TEXT = {
    "core": "every request served by the engine core's own code (`CoreServer`) on a socket pair, its event loop "
    "on another thread reading every stream and writing the events as frames (as serving reads them)",
    "loop": "every stream read on an asyncio loop in another thread (as serving reads them)",
    "none": "no stream read during the steps",
}


def _sampling_text(name: str) -> str:
    return ", ".join(f"{k} {v}" for k, v in SAMPLING[name].items())


def _plot(results: dict[str, dict[str, dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MODES), figsize=(10, 4), sharey=True)
    for ax, mode in zip(axes, MODES):
        for name, res in results.items():
            ax.plot(SEQS, [res[f"{mode}/{n}"]["host"] for n in SEQS], marker="o", label=name)
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="1 ms")
        ax.set_title(f"speculative {mode}")
        ax.set_xlabel("decoding sequences")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("host ms per step")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
