"""The engine end to end on a CUDA device: a random-weight Llama-shaped model built there, no weights carried.

Run by `bench/gpu_check.sh` after the kernel checks (torch 2.11 / triton 3.6 on the device, no network).
For each weight format (bf16, and int4 weight-only through the Triton W4A16 matmuls):

1. **Batch invariance, end to end.** The same greedy requests run each alone, all together, arriving
   one every few steps, and in small prefill chunks: every token and every token's logprob must be
   bitwise equal across them (a token's logits never depend on what else shares the step); a token or
   a logprob that differs fails the run.
2. **Device faults.** A second engine with injected faults (HELEXA_FAULT_INJECT) mid-prefill and
   mid-decode reloads the model and replays: the same tokens and logprobs, bit for bit, two reloads, the block
   count of the first load, and a budget computed from the device's totals identical across loads.
3. **Decode speed.** The median step time of pure-decode steps at 1, 16 and 64 streams, with decode
   steps replayed from CUDA graphs (the default on a GPU) and eagerly (`enforce_eager`), the host time
   spent inside the model's forward (launching its kernels: what the graphs remove), next to the step's
   bytes roofline (weights + KV read once, at the copy bandwidth measured here). The checks above run
   with the default, so on a GPU they check the graphs' padded replays too.

Prints one markdown table per section (also appended to `--out`) and exits non-zero on any failure.
`--dry-run` runs the same logic on the CPU (float32, the Triton interpreter off) with a tiny model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]

import torch  # noqa: E402

from helexa.config import EngineConfig  # noqa: E402
from helexa.engine.engine import Engine  # noqa: E402
from helexa.model.sampling import SamplingParams  # noqa: E402
from tests.support.engines import assert_released, drive  # noqa: E402
from tests.support.models import build_tiny_tokenizer_dir, make_tiny_model  # noqa: E402

LINES: list[str] = []
FAILURES: list[str] = []


def emit(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def check(ok: bool, what: str) -> str:
    if not ok:
        FAILURES.append(what)
    return "ok" if ok else "FAIL"


# Llama-3.2-1B's layer shape (hidden 2048, 32 query / 8 KV heads of 64, MLP 8192), 4 layers, a 32k vocabulary.
DEVICE_SHAPE = dict(
    vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=4, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
)  # fmt: skip
DRY_SHAPE = dict(vocab_size=512, max_position_embeddings=512)


def build_model(root: Path, dry: bool) -> Path:
    """A random Llama-shaped checkpoint (safetensors) with a small trained tokenizer, built here."""
    start = time.perf_counter()
    path = make_tiny_model(root, "llama", name="model", **(DRY_SHAPE if dry else DEVICE_SHAPE))
    build_tiny_tokenizer_dir(path)
    emit(f"model built in {time.perf_counter() - start:.1f} s: {path}")
    return path


def engine_config(model: Path, dry: bool, quantization: str, **overrides) -> EngineConfig:
    args = dict(model=str(model), max_num_seqs=64, block_size=16, max_num_batched_tokens=512, max_wait_secs=120.0,
                prefix_cache=False, quantization=quantization)  # fmt: skip
    if dry:
        args.update(device="cpu", dtype="float32", num_blocks=512)
    else:  # the budget from the device's totals: a fraction of its memory, less weights and activations
        # (2% of an H200: ~16k blocks, small enough for the integrity check after every step)
        args.update(device="cuda", dtype="bfloat16", gpu_memory_utilization=0.02)
    return EngineConfig.of(**{**args, **overrides})


def prompts(n: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    return [torch.randint(3, 400, (length,), generator=gen).tolist() for length in lengths]


Outputs = list[tuple[tuple[int, ...], tuple[float, ...]]]


def outputs(engine: Engine, handles) -> Outputs:
    events = drive(engine, handles, max_steps=5000)
    result = []
    for h in handles:
        evs = events[h.request_id]
        final = evs[-1]
        if final.finish_reason not in ("length", "stop"):
            raise RuntimeError(f"request {h.request_id} ended with {final.finish_reason}: {final.error!r}")
        result.append((tuple(t for e in evs for t in e.token_ids), tuple(lp.logprob for e in evs for lp in e.logprobs)))
    return result


def run_alone(engine: Engine, batch: list[list[int]], params: SamplingParams) -> Outputs:
    return [outputs(engine, [engine.submit(p, params)])[0] for p in batch]


def run_together(engine: Engine, batch: list[list[int]], params: SamplingParams) -> Outputs:
    return outputs(engine, [engine.submit(p, params) for p in batch])


def run_staggered(engine: Engine, batch: list[list[int]], params: SamplingParams, every: int = 3) -> Outputs:
    """One request arrives every `every` steps, so each joins a batch of others mid-prefill or mid-decode."""
    handles = []
    for p in batch:
        handles.append(engine.submit(p, params))
        for _ in range(every):
            engine.step()
            engine.check_integrity()
    # drive() reads what the streams already hold, so the earlier steps' events are not lost
    return outputs(engine, handles)


def same_tokens(a: Outputs, b: Outputs) -> bool:
    return [t for t, _ in a] == [t for t, _ in b]


def first_difference(a: Outputs, b: Outputs) -> str:
    """The first differing token (any request), else the first differing logprob, else "-"."""
    for i, ((ta, _), (tb, _)) in enumerate(zip(a, b)):
        if ta != tb:
            k = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
            return f"request {i}: token {k}: {ta[k : k + 3]} vs {tb[k : k + 3]}"
    for i, ((_, la), (_, lb)) in enumerate(zip(a, b)):
        if la != lb:
            k = next(j for j, (x, y) in enumerate(zip(la, lb)) if x != y)
            return f"request {i}: logprob {k}: {la[k]!r} vs {lb[k]!r} (same tokens)"
    return "-"


def invariance(model: Path, dry: bool, quantization: str) -> tuple[Engine, list[list[int]], SamplingParams, Outputs]:
    """Section 1 for one weight format; returns the engine, the requests and their outputs alone."""
    batch = prompts(6, seed=1, lo=5, hi=60) if dry else prompts(12, seed=1, lo=20, hi=700)
    params = SamplingParams(max_tokens=12 if dry else 32, temperature=0.0, ignore_eos=True, logprobs=0)
    engine = Engine(engine_config(model, dry, quantization))
    budget = engine.budget
    emit(
        f"engine ({quantization} weights): {engine.device} {engine.dtype}, budget {budget.source}: "
        f"{budget.num_blocks} blocks x {budget.bytes_per_block} B of {budget.total_memory_bytes / 2**30:.1f} GiB "
        f"(weights {budget.weight_bytes / 2**20:.0f} MiB, "
        f"activations {budget.activation_reserve_bytes / 2**20:.0f} MiB)"
    )
    emit()
    emit("| weights | composition | tokens | greedy tokens = alone | logprobs bitwise = alone | first difference |")
    emit("|---|---|---:|---|---|---|")
    alone = run_alone(engine, batch, params)
    emit(f"| {quantization} | each alone | {sum(len(t) for t, _ in alone)} | reference | reference | - |")
    small = Engine(engine_config(model, dry, quantization, max_num_batched_tokens=64))  # many small chunks
    runs = [("all together", engine, run_together), ("one every 3 steps", engine, run_staggered),
            ("together, 64-token chunks", small, run_together)]  # fmt: skip
    for name, eng, fn in runs:
        got = fn(eng, batch, params)
        emit(f"| {quantization} | {name} | {sum(len(t) for t, _ in got)} | "
             f"{check(same_tokens(got, alone), f'{quantization} {name}: greedy tokens differ from alone')} | "
             f"{check(got == alone, f'{quantization} {name}: logprobs differ from alone')} | "
             f"{first_difference(alone, got)} |")  # fmt: skip
    assert_released(small)
    small.shutdown()
    assert_released(engine)
    emit()
    return engine, batch, params, alone


def faults(model: Path, dry: bool, quantization: str, engine: Engine, batch, params, alone: Outputs) -> None:
    """Section 2: a run with injected device faults replays to the clean run's tokens, same blocks and budget."""
    budget = engine.budget
    os.environ["HELEXA_FAULT_INJECT"] = "2,7"  # steps counted from 1: mid-prefill and mid-decode
    try:
        faulty = Engine(engine_config(model, dry, quantization, fault_backoff_secs=0.0))
    finally:
        del os.environ["HELEXA_FAULT_INJECT"]
    try:
        replayed = run_together(faulty, batch, params)
        c = faulty.counters
        rows = [
            ("tokens and logprobs after two faults = clean run, bit for bit", replayed == alone,
             first_difference(alone, replayed)),
            ("device faults, reloads", c.device_faults == 2 and c.model_reloads == 2,
             f"{c.device_faults}, {c.model_reloads}"),
            ("block count after reload = first load", faulty.pool.num_blocks == faulty.first_num_blocks,
             f"{faulty.pool.num_blocks} vs {faulty.first_num_blocks}"),
            ("budget after reload = budget of another load", faulty.budget == budget,
             f"{faulty.budget.num_blocks} blocks, {faulty.budget.available_bytes} B available"),
        ]  # fmt: skip
        emit("| weights | device fault check | result | detail |")
        emit("|---|---|---|---|")
        for what, ok, detail in rows:
            emit(f"| {quantization} | {what} | {check(ok, f'{quantization} faults: {what}')} | {detail} |")
        assert_released(faulty)
    finally:
        faulty.shutdown()
    emit()


def decode_speed(engine: Engine, dry: bool, quantization: str, copy_bw: float) -> None:
    """Median pure-decode step time at each stream count, against the step's bytes roofline (the weights
    and every stream's KV read once at the measured copy bandwidth)."""
    context, steps, chunk = (32, 6, 512) if dry else (512, 40, 512)
    for streams in (1, 4) if dry else (1, 16, 64):
        batch = prompts(streams, seed=streams, lo=context, hi=context)
        # more tokens than the run needs: every stream still decodes during the timed steps; aborted after them
        params = SamplingParams(max_tokens=min(400, engine.max_model_len - context), temperature=0.0, ignore_eos=True)
        handles = [engine.submit(p, params) for p in batch]
        started: set[str] = set()
        done: set[str] = set()

        def pump(handles=handles, started=started, done=done) -> None:
            for h in handles:
                while (e := h.stream.get(timeout=0)) is not None:
                    started.add(h.request_id)
                    if e.finished:
                        done.add(h.request_id)

        for _ in range(2000):  # until every stream has its first token: every step after this is pure decode
            engine.step()
            pump()
            if len(started) == streams:
                break
        times, launches = [], []
        model = engine.runner.model
        forward = model.forward

        def timed_forward(
            *args, forward=forward, launches=launches, **kwargs
        ):  # host time inside the model's forward: launching its kernels
            begin = time.perf_counter()
            result = forward(*args, **kwargs)
            launches.append(time.perf_counter() - begin)
            return result

        model.forward = timed_forward
        try:
            for _ in range(steps):
                begin = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - begin)
                pump()
        finally:
            del model.forward  # the class's forward again
        early = len(done)
        for h in handles:
            engine.abort(h.request_id)
        for _ in range(100):
            if len(done) == streams:
                break
            engine.step()
            pump()
        if early or len(done) != streams:
            raise RuntimeError(f"{streams} streams: {early} ended inside the timed steps, {len(done)} ended in all")
        assert_released(engine)
        step, launch = statistics.median(times[2:]), statistics.median(launches[2:] or [float("nan")])
        kv_bytes = streams * (context + steps // 2) * engine.budget.bytes_per_block // engine.budget.block_size
        roof = (engine.budget.weight_bytes + kv_bytes) / copy_bw
        emit(
            f"| {quantization} | {streams} | {step * 1e3:8.3f} | {launch * 1e3:8.3f} | {streams / step:8.1f} | "
            f"{roof * 1e3:7.3f} | {roof / step:6.1%} | {len(times) - 2} |"
        )


def copy_bandwidth(dry: bool) -> float:
    n = (1 << 22) if dry else (1 << 30)
    src = torch.randn(n // 4, device="cpu" if dry else "cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        if not dry:
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if not dry:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * n / statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, float32, a tiny model")
    parser.add_argument("--out", default=str(Path(__file__).parent / "out" / "gpu_engine.md"))
    parser.add_argument(
        "--formats", default=None, help="weight formats (--quantization values), in order; default none,int4 "
        "(a dry run: int4, the CPU's fused step: the CPU's dense torch layers promise the same tokens, not bits)"
    )  # fmt: skip
    parser.add_argument("--speed-only", action="store_true", help="only the decode speed section")
    args = parser.parse_args()
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        sys.exit("gpu_engine: no CUDA device (use --dry-run to exercise the script on CPU)")
    start = time.perf_counter()
    dev = "CPU (dry run)" if dry else torch.cuda.get_device_name()
    emit(f"# helexa gpu_engine — {dev}; torch {torch.__version__}")
    emit()
    copy_bw = copy_bandwidth(dry)
    with tempfile.TemporaryDirectory() as root:
        model = build_model(Path(root), dry)
        engines = []
        for quantization in (args.formats or ("int4" if dry else "none,int4")).split(","):
            if args.speed_only:
                engines.append((quantization, Engine(engine_config(model, dry, quantization))))
                continue
            try:
                engine, batch, params, alone = invariance(model, dry, quantization)
                engines.append((quantization, engine))
            except Exception:
                FAILURES.append(f"{quantization} invariance: raised")
                emit("```\n" + traceback.format_exc() + "```")
                continue
            try:
                faults(model, dry, quantization, engine, batch, params, alone)
            except Exception:
                FAILURES.append(f"{quantization} faults: raised")
                emit("```\n" + traceback.format_exc() + "```")
        emit(f"## decode steps (copy bandwidth {copy_bw / 1e9:.0f} GB/s)")
        emit()
        emit("| weights | streams | step ms | of it in the forward (host) ms | tokens/s | roofline ms | of roofline "
             "| steps |")  # fmt: skip
        emit("|---|---:|---:|---:|---:|---:|---:|---:|")
        for quantization, engine in engines:
            # the default engine (decode steps from CUDA graphs on a GPU), then the same weights eagerly
            for label, eng in ((quantization, engine), (f"{quantization}, eager", None)):
                try:
                    if eng is None:
                        if dry:  # no graphs off CUDA: the eager row would repeat the first
                            continue
                        eng = Engine(engine_config(model, dry, quantization, enforce_eager=True))
                    decode_speed(eng, dry, label, copy_bw)
                except Exception:
                    FAILURES.append(f"{label} decode speed: raised")
                    emit("```\n" + traceback.format_exc() + "```")
                if eng is not None:
                    eng.shutdown()
    emit()
    emit(
        f"finished in {time.perf_counter() - start:.0f} s; "
        + ("all checks passed" if not FAILURES else f"FAILURES: {FAILURES}")
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(LINES) + "\n")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
