"""Serving an 8B-shaped model on a GPU: time to first token, inter-token latency, tokens/s and the decode
step against its bytes roofline, at 1, 16 and 64 concurrent streams, in bf16 and with int4 weights (W4A16).

The model is Llama-3-8B's shape (hidden 4096, 32 layers, 32 query / 8 KV heads of 128, MLP 14336,
vocabulary 128,256) with seeded random weights made on the device (`--load-format dummy`: no weight
file is written or carried), and a small trained tokenizer; prompts are random token ids. The engine
runs in this process and is stepped here (no HTTP): every request arrives at once; a token's time is
the end of the step that streamed it. Speculative decoding is off (plain decoding, every stream one
token a step). The decode step is the median step while every stream decodes; its roofline is the
weights plus every stream's KV read once at the device-to-device copy bandwidth measured here.

Writes a markdown table and a plot (`--out`, `.md` and `.png`). `--dry-run` runs a tiny shape on the CPU.
Run on the device by `bench/gpu_check.sh` (after the engine and kernel checks, within its budget).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]

import torch  # noqa: E402

from helexa.config import EngineConfig  # noqa: E402
from helexa.engine.engine import Engine  # noqa: E402
from helexa.model.sampling import SamplingParams  # noqa: E402
from tests.support.models import build_tiny_tokenizer_dir, tiny_hf_config  # noqa: E402

LLAMA_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=8192, rope_theta=500000.0,
)  # fmt: skip
TINY = dict(vocab_size=512, max_position_embeddings=512)
LINES: list[str] = []


def emit(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def model_dir(root: Path, dry: bool) -> Path:
    """config.json of the shape and a tokenizer: all `--load-format dummy` needs."""
    path = root / "model"
    path.mkdir()
    tiny_hf_config("llama", **(TINY if dry else LLAMA_8B)).to_json_file(str(path / "config.json"))
    build_tiny_tokenizer_dir(path)
    return path


def copy_bandwidth(device: str) -> float:
    n = 1 << (22 if device == "cpu" else 30)
    src = torch.randn(n // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return 2 * n / statistics.median(times)


def serve(engine: Engine, streams: int, prompt_len: int, output_len: int, seed: int) -> dict[str, float]:
    """All `streams` requests at once; step until every one has ended; the latencies and step times."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 400, (prompt_len,), generator=gen).tolist() for _ in range(streams)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    handles = [engine.submit(p, params) for p in prompts]
    stamps: dict[str, list[float]] = {h.request_id: [] for h in handles}
    done: set[str] = set()
    decode_steps: list[float] = []
    for _ in range(100_000):
        if len(done) == streams:
            break
        all_decoding = all(stamps[h.request_id] for h in handles) and not done
        begin = time.perf_counter()
        engine.step()
        end = time.perf_counter()
        if all_decoding:
            decode_steps.append(end - begin)
        for h in handles:
            while (event := h.stream.get(timeout=0)) is not None:
                stamps[h.request_id] += [end] * len(event.token_ids)
                if event.finished:
                    if event.finish_reason not in ("length", "stop"):
                        raise RuntimeError(f"{h.request_id} ended with {event.finish_reason}: {event.error!r}")
                    done.add(h.request_id)
    else:
        raise RuntimeError(f"{streams} streams did not end")
    elapsed = time.perf_counter() - start
    ttft = [s[0] - start for s in stamps.values()]
    gaps = [b - a for s in stamps.values() for a, b in zip(s, s[1:])]
    tokens = sum(len(s) for s in stamps.values())
    return dict(
        ttft_ms=statistics.median(ttft) * 1e3, ttft_max_ms=max(ttft) * 1e3, itl_ms=statistics.median(gaps) * 1e3,
        tokens_per_s=tokens / elapsed, step_ms=statistics.median(decode_steps[1:] or decode_steps) * 1e3,
    )  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="a tiny shape on the CPU")
    parser.add_argument("--formats", default="none,int4", help="--quantization values, in order")
    parser.add_argument("--out", default=str(Path(__file__).parent / "out" / "gpu_serve.md"))
    args = parser.parse_args()
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        sys.exit("gpu_serve: no CUDA device (use --dry-run to exercise the script on CPU)")
    device = "cpu" if dry else "cuda"
    prompt_len, output_len = (24, 8) if dry else (512, 128)
    stream_counts = (1, 4) if dry else (1, 16, 64)
    copy_bw = copy_bandwidth(device)
    name = "CPU (dry run)" if dry else torch.cuda.get_device_name()
    emit(f"# helexa gpu_serve — {name}; torch {torch.__version__}; copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    emit()
    shape = "tiny Llama" if dry else "Llama-3-8B shape (random weights)"
    emit(f"{shape}; prompts of {prompt_len} tokens, {output_len} output tokens each, greedy, no speculation")
    emit()
    emit("| weights | streams | TTFT median ms | TTFT max ms | ITL median ms | tokens/s | decode step ms "
         "| roofline ms | of roofline |")  # fmt: skip
    emit("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    results: dict[str, list[tuple[int, float]]] = {}
    with tempfile.TemporaryDirectory() as root:
        path = model_dir(Path(root), dry)
        for quantization in args.formats.split(","):
            config = dict(model=str(path), load_format="dummy", quantization=quantization, max_num_seqs=64,
                          max_num_batched_tokens=2048, speculative="off", prefix_cache=False,
                          max_wait_secs=600.0)  # fmt: skip
            if dry:
                config.update(device="cpu", dtype="float32", num_blocks=1024, block_size=16)
            else:
                config.update(device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3)
            start = time.perf_counter()
            engine = Engine(EngineConfig.of(**config))
            loaded = time.perf_counter() - start
            budget = engine.budget
            emit(f"| {quantization} | loaded in {loaded:.1f} s; weights {budget.weight_bytes / 2**30:.2f} GiB, "
                 f"{budget.num_blocks} KV blocks | | | | | | | |")  # fmt: skip
            for streams in stream_counts:
                r = serve(engine, streams, prompt_len, output_len, seed=streams)
                context = prompt_len + output_len // 2
                kv = streams * context * budget.bytes_per_block / budget.block_size
                roof = (budget.weight_bytes + kv) / copy_bw * 1e3
                emit(
                    f"| {quantization} | {streams} | {r['ttft_ms']:9.1f} | {r['ttft_max_ms']:9.1f} "
                    f"| {r['itl_ms']:7.2f} "
                    f"| {r['tokens_per_s']:9.1f} | {r['step_ms']:7.2f} | {roof:6.3f} | {roof / r['step_ms']:6.1%} |"
                )
                results.setdefault(quantization, []).append((streams, r["tokens_per_s"]))
            engine.shutdown()
            del engine
            if not dry:
                torch.cuda.empty_cache()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(LINES) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for quantization, points in results.items():
            ax.plot([s for s, _ in points], [t for _, t in points], marker="o", label=quantization)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("tokens/s")
        ax.set_xscale("log", base=2)
        ax.set_title(f"helexa on {name}: {shape}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
    except ImportError:
        emit("(matplotlib missing: no plot)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
