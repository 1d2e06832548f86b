"""Random-weight GGUFs at real model shapes, quantized by llama.cpp's own quantizer (issue 36).

A benchmark at the 1B and 8B sizes needs a file both engines run, and no such model is cached here.
`ensure(name, llama)` makes one, once, into `$HELEXA_HOME/bench/`: a float16 GGUF of the shape's
`llama` architecture with random weights (normal, std 0.02; norms 1) and the default model's
tokenizer (SmolLM2's 49,152-token BPE, copied from its GGUF, so helexa's tokenizer gives both
engines the same ids), then `llama_model_quantize` (llama.cpp's C API, the code behind
`llama-quantize`) turns it into Q4_1 layers with a tied Q8_0 token embedding / output head, the
layout of the default model's file. The float16 file is deleted afterwards.

Shapes: `1b` is TinyLlama-1.1B's layers (2048 hidden, 22 layers, 5632 FFN, 32 query / 4 KV heads),
`8b` Llama-3-8B's (4096 hidden, 32 layers, 14336 FFN, 32 / 8 heads, RoPE base 500000); both with
the 49,152-token vocabulary, so the embedding is smaller than those models' own (1B: 1.03B
parameters, 8B: 7.2B).

    python bench/random_gguf.py 1b 8b      # makes the files (needs the llama.cpp peer, .peers/)
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from helexa.model.weights.pull import helexa_home, known_gguf  # noqa: E402

__all__ = ["SHAPES", "Shape", "ensure", "path_for"]


@dataclass(frozen=True)
class Shape:
    """A decoder's shape (`llama` architecture)."""

    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    rope_theta: float
    context: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tensors(self, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
        """(GGUF name, numpy shape (rows, cols)) of every tensor, in file order."""
        kv = self.kv_heads * self.head_dim
        out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, self.hidden))]
        for i in range(self.layers):
            out += [
                (f"blk.{i}.attn_norm.weight", (self.hidden,)),
                (f"blk.{i}.attn_q.weight", (self.hidden, self.hidden)),
                (f"blk.{i}.attn_k.weight", (kv, self.hidden)),
                (f"blk.{i}.attn_v.weight", (kv, self.hidden)),
                (f"blk.{i}.attn_output.weight", (self.hidden, self.hidden)),
                (f"blk.{i}.ffn_norm.weight", (self.hidden,)),
                (f"blk.{i}.ffn_gate.weight", (self.ffn, self.hidden)),
                (f"blk.{i}.ffn_up.weight", (self.ffn, self.hidden)),
                (f"blk.{i}.ffn_down.weight", (self.hidden, self.ffn)),
            ]
        out.append(("output_norm.weight", (self.hidden,)))
        return out


SHAPES: dict[str, Shape] = {
    "1b": Shape(hidden=2048, layers=22, ffn=5632, heads=32, kv_heads=4, rope_theta=10000.0, context=8192 * 2),
    "8b": Shape(hidden=4096, layers=32, ffn=14336, heads=32, kv_heads=8, rope_theta=500000.0, context=8192 * 2),
}


def path_for(name: str) -> Path:
    """Where `ensure(name)` keeps the quantized file."""
    return helexa_home() / "bench" / f"random-{name}.Q4_1.gguf"


def _tokenizer_fields(source: Path) -> list[tuple[str, Any, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    """(key, value, type, element type) of every `tokenizer.*` field of the GGUF `source`."""
    reader = gguf.GGUFReader(source)
    out = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        out.append((key, field.contents(), vtype, sub))
    return out


def write_f16(shape: Shape, path: Path, tokenizer_source: Path, seed: int = 0) -> None:
    """A float16 GGUF of `shape` with random weights, written tensor by tensor (memory: one tensor)."""
    fields = _tokenizer_fields(tokenizer_source)
    vocab = next(len(v) for k, v, *_ in fields if k == "tokenizer.ggml.tokens")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(f"random {path.stem}")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, value, vtype, sub in fields:
        writer.add_key_value(key, value, vtype, sub)
    tensors = shape.tensors(vocab)
    for name, dims in tensors:
        dtype = np.float32 if len(dims) == 1 else np.float16  # norms stay float32, as converters write them
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, dims in tensors:
        if len(dims) == 1:
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))
        else:
            writer.write_tensor_data((rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16))
    writer.close()


def quantize(llama: Any, source: Path, target: Path, threads: int) -> None:
    """`source` (float16) -> `target`: Q4_1 matrices, the tied token embedding in Q8_0, by llama.cpp's
    `llama_model_quantize` (`llama` is the `llama_cpp` module); RuntimeError when it fails."""
    params = llama.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = llama.LLAMA_FTYPE_MOSTLY_Q4_1
    params.token_embedding_type = llama.GGML_TYPE_Q8_0
    params.output_tensor_type = llama.GGML_TYPE_Q8_0
    params.pure = True  # every matrix Q4_1 (no per-layer type mix), except the two above
    rc = llama.llama_model_quantize(str(source).encode(), str(target).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({source} -> {target}) returned {rc}")


def ensure(name: str, llama: Any, threads: int = 2) -> Path:
    """The quantized random GGUF of shape `name` (a key of SHAPES), made once (see the module doc)."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    target = path_for(name)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    f16 = target.with_name(f".random-{name}.F16.gguf")
    partial = target.with_name(f".{target.name}.partial")
    try:
        t0 = time.perf_counter()
        write_f16(SHAPES[name], f16, known_gguf(progress=False))
        print(f"wrote {f16} ({f16.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.0f}s", flush=True)
        t0 = time.perf_counter()
        quantize(llama, f16, partial, threads)
        partial.replace(target)
        print(f"quantized {target} ({target.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.0f}s")
    finally:
        f16.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shapes", nargs="+", choices=sorted(SHAPES))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    from peer_llama_cpp import import_llama_cpp  # noqa: PLC0415 (bench/ is on the path when run as a script)

    llama = import_llama_cpp()
    if llama is None:
        return 1
    for name in args.shapes:
        print(ensure(name, llama, args.threads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
