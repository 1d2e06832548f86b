"""The llama.cpp peer of bench/peers.py: its C API through llama-cpp-python's ctypes bindings (built
into `.peers/` by `bash bench/setup_llama_cpp.sh`), and one engine's measurement run in a process
of its own (`python bench/peer_llama_cpp.py PLAN.json RESULT.json`, started by peers.py), which
imports neither torch nor helexa, so its peak RSS is llama.cpp's, Python's and numpy's alone.

Multi-stream decode uses llama.cpp's low-level batch API: one context with `n_seq_max = streams`
(per-sequence KV, `kv_unified` off), a `llama_batch` holding one token per stream each step
(`seq_id` = stream), one `llama_decode` per step, greedy argmax over each stream's logits row.
Every other context parameter is llama.cpp's default (float16 K/V; flash attention `auto`, on for
the CPU), but `n_batch = n_ubatch = 512` and the thread counts.
"""

from __future__ import annotations

import ctypes
import json
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from machine import cpu_has_amx  # bench/ is this script's directory: on sys.path

ROOT = Path(__file__).resolve().parents[1]
PEERS_DIR = ROOT / ".peers"
BUILD_HINT = "build it with `bash bench/setup_llama_cpp.sh` (5-10 minutes on 2 cores; installs into .peers/)"

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import memory_mib, paired_segments  # noqa: E402


def import_llama_cpp():
    """llama_cpp from `.peers/` (or the environment), its logging cut to errors; None when it is not built."""
    if str(PEERS_DIR) not in sys.path and PEERS_DIR.is_dir():
        sys.path.append(str(PEERS_DIR))  # last: the venv's numpy, jinja2, ... win over the copies pip put there
    try:
        import llama_cpp
        import llama_cpp._logger  # installs the log callback that honours the logger's level
    except Exception as exc:  # ImportError, or a shared library that fails to load
        print(f"llama.cpp peer unavailable ({type(exc).__name__}: {exc}); {BUILD_HINT}", flush=True)
        return None
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    return llama_cpp


class LlamaCppModel:
    """A GGUF loaded through llama.cpp's C API (`llama_model_load_from_file`, mmap'd), CPU only."""

    def __init__(self, lib, gguf: Path, threads: int) -> None:
        self.lib, self.threads = lib, threads
        lib.llama_backend_init()
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        if cpu_has_amx():  # its AMX buffer type segfaulted on an AMX Xeon (issue 36): the plain CPU buffers
            params.use_extra_bufts = False
        self.model = lib.llama_model_load_from_file(str(gguf).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))

    def context(self, n_seq_max: int, n_ctx_per_seq: int, n_batch: int = 512) -> LlamaCppContext:
        return LlamaCppContext(self, n_seq_max, n_ctx_per_seq, n_batch)

    def close(self) -> None:
        if self.model:
            self.lib.llama_model_free(self.model)
            self.model = None


class LlamaCppContext:
    """One llama.cpp context of `n_seq_max` sequences (each its own KV of `n_ctx_per_seq` tokens) and a
    batch of up to `n_batch` tokens; `decode` runs one `llama_decode` over tokens of any sequences."""

    def __init__(self, owner: LlamaCppModel, n_seq_max: int, n_ctx_per_seq: int, n_batch: int) -> None:
        lib = self.lib = owner.lib
        self.n_vocab, self.n_batch = owner.n_vocab, n_batch
        params = lib.llama_context_default_params()
        params.n_ctx = n_seq_max * n_ctx_per_seq
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = n_seq_max
        params.n_threads = params.n_threads_batch = owner.threads
        params.kv_unified = False  # per-sequence KV streams: the faster layout for unrelated sequences
        params.no_perf = True
        self.ctx = lib.llama_init_from_model(owner.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {n_seq_max} x {n_ctx_per_seq} tokens")
        self.batch = lib.llama_batch_init(n_batch, 0, 1)

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def decode(self, tokens: Sequence[tuple[int, int, int, bool]]) -> np.ndarray:
        """Run `(token, position, seq_id, wants_logits)` entries (at most n_batch) through one `llama_decode`;
        returns the logits rows of the entries that want them, in order: (R, V) float32 (a copy)."""
        b = self.batch
        b.n_tokens = len(tokens)
        rows = 0
        for i, (tok, pos, seq, out) in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1 if out else 0
            rows += bool(out)
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for a batch of {len(tokens)} tokens")
        if rows == 0:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        ptr = self.lib.llama_get_logits(self.ctx)
        flat = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(rows * self.n_vocab,))
        return flat.reshape(rows, self.n_vocab).copy()

    def prefill(self, ids: Sequence[int], seq: int = 0, all_logits: bool = False) -> np.ndarray:
        """Feed `ids` to sequence `seq` from position 0 in n_batch chunks; the last row's logits (1, V),
        or every position's (T, V) with `all_logits`."""
        out = []
        for start in range(0, len(ids), self.n_batch):
            chunk = ids[start : start + self.n_batch]
            last = start + len(chunk) == len(ids)
            entries = [(t, start + i, seq, all_logits or (last and i == len(chunk) - 1)) for i, t in enumerate(chunk)]
            out.append(self.decode(entries))
        return np.concatenate(out)

    def greedy(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> tuple[list[list[int]], float, float]:
        """Greedy continuations of `prompts` (one sequence each, decoded together in one batch per step).

        Returns (tokens per prompt, seconds until every prompt had its first token, seconds of the
        decode steps after that)."""
        if len(prompts) > self.n_batch:
            raise ValueError(f"{len(prompts)} streams exceed the batch of {self.n_batch}")
        self.clear()
        start = time.perf_counter()
        outs = [[int(self.prefill(p, seq=s)[-1].argmax())] for s, p in enumerate(prompts)]
        first = time.perf_counter()
        for _ in range(new_tokens - 1):
            step = [(o[-1], len(p) + len(o) - 1, s, True) for s, (p, o) in enumerate(zip(prompts, outs))]
            logits = self.decode(step)
            for o, row in zip(outs, logits.argmax(axis=1).tolist()):
                o.append(int(row))
        end = time.perf_counter()
        return outs, first - start, end - first

    def close(self) -> None:
        if self.ctx:
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            self.ctx = None


def _ctx_per_seq(tokens: int) -> int:
    return -(-(tokens + 8) // 256) * 256


def measure(lib, plan: dict[str, Any]) -> dict[str, Any]:
    """Run `plan` (see bench/peers.py: `child_plan`) on llama.cpp; the result's fields as peers.py reads them."""
    result: dict[str, Any] = {"decode": {}, "prefill": {}, "prefill_ttft_ms": {}, "memory_start": memory_mib()}
    model = LlamaCppModel(lib, Path(plan["gguf"]), plan["threads"])
    result["memory_loaded"] = memory_mib()
    largest = 0  # tokens of KV the largest context held
    try:
        chat, new_tokens = plan["chat"], plan["new_tokens"]
        for i, n in enumerate(plan["streams"]):
            per_seq = _ctx_per_seq(max(len(p) for p in chat[:n]) + new_tokens)
            ctx = model.context(n_seq_max=n, n_ctx_per_seq=per_seq)
            largest = max(largest, n * per_seq)
            try:
                if i == 0:
                    ctx.greedy(chat[:1], 4)  # warm-up
                outs, _, seconds = ctx.greedy(chat[:n], new_tokens)
                result["decode"][str(n)] = sum(len(o) - 1 for o in outs) / seconds
                print(f"  llama.cpp {n:>2} streams x {new_tokens}: {result['decode'][str(n)]:.1f} tok/s", flush=True)
            finally:
                ctx.close()
        if plan.get("roofline_segments"):  # one-stream runs, each between two bandwidth samples (peers.py)
            per_seq = _ctx_per_seq(max(len(p) for p in chat) + new_tokens)
            ctx = model.context(n_seq_max=1, n_ctx_per_seq=per_seq)
            largest = max(largest, per_seq)
            try:

                def one_stream(prompt: Sequence[int]) -> tuple[int, float, float]:
                    outs, _, seconds = ctx.greedy([prompt], new_tokens)
                    return len(outs[0]) - 1, seconds, 0.0

                result["roofline"] = paired_segments(plan["roofline_segments"], chat, one_stream)
            finally:
                ctx.close()
        for length, prompts in plan["prefill"].items():
            ctx = model.context(n_seq_max=1, n_ctx_per_seq=_ctx_per_seq(int(length)))
            largest = max(largest, _ctx_per_seq(int(length)))
            try:
                ttfts = []
                for p in prompts:
                    ctx.clear()
                    t0 = time.perf_counter()
                    int(ctx.prefill(p)[-1].argmax())
                    ttfts.append(time.perf_counter() - t0)
                ttft = statistics.median(ttfts)
                result["prefill"][length], result["prefill_ttft_ms"][length] = int(length) / ttft, ttft * 1e3
                print(f"  llama.cpp prefill {length} tokens: {int(length) / ttft:.0f} tok/s", flush=True)
            finally:
                ctx.close()
        if plan.get("long"):
            prompt, new = plan["long"]["prompt"], plan["long"]["new_tokens"]
            ctx = model.context(n_seq_max=1, n_ctx_per_seq=_ctx_per_seq(len(prompt) + new))
            largest = max(largest, _ctx_per_seq(len(prompt) + new))
            try:
                outs, first, seconds = ctx.greedy([prompt], new)
                result["long_decode"] = (len(outs[0]) - 1) / seconds
                result["long_prefill"] = len(prompt) / first
                print(f"  llama.cpp decode at {len(prompt)} context: {result['long_decode']:.1f} tok/s", flush=True)
            finally:
                ctx.close()
    finally:
        model.close()
    result["kv_tokens"] = largest
    result["memory_end"] = memory_mib()
    return result


def main(argv: list[str]) -> int:
    plan_path, result_path = map(Path, argv)
    plan = json.loads(plan_path.read_text())
    lib = import_llama_cpp()
    if lib is None:
        result = {"error": f"llama.cpp peer unavailable; {BUILD_HINT}"}
    else:
        try:
            result = measure(lib, plan)
        except Exception as exc:  # reported in the table, the other engine still runs
            result = {"error": f"{type(exc).__name__}: {exc}"}
    result_path.write_text(json.dumps(result))
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
