"""Quantized weights: GGUF blocks kept exactly, quantizing at load, the CPU execution of both, and the
loader's `quantization` modes. Oracles: gguf-py's own dequantisation (bitwise), the dense float
weights (within the layout's error), and the same math in float64 with the rounding each CPU kernel
documents (helexa's: int8 activation blocks; torch's: bfloat16 activations, scales and outputs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer

from helexa.model.loader import load_model
from helexa.model.quant import QuantEmbedding, QuantizedWeight, QuantLinear, isa, native, quantize_int4, quantize_int8
from helexa.model.quant.cpu import DENSE_ROWS, CpuQuantMatmul, cpu_kernel
from helexa.model.weights.gguf import convert_gguf
from helexa.model.weights.gguf_quant import read_quantized
from tests.support.gguf import Q, train_tiny_bpe, write_tiny_gguf
from tests.support.kernel_paths import kernel_paths, use_emulated_amx, use_kernel_path
from tests.support.models import PagedCache, make_tiny_model


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return train_tiny_bpe()


def _logits(model, tokens: list[int]) -> torch.Tensor:
    cache = PagedCache(model.config, num_blocks=16, block_size=4, dtype=model.dtype)
    step = cache.step({0: tokens}, all_logits=True)
    return model(step.input_ids, step.positions, step.attn, cache.kv_caches, step.logits_indices)


def _random_blocks(rows: int, cols: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """Random raw GGUF blocks of `kind`: fp16 scales (and minimums) of either sign, random payload."""
    nblocks, size = rows * cols // 32, {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    blocks = rng.integers(0, 256, (nblocks, size), dtype=np.uint8)
    heads = 4 if kind == "Q4_1" else 2
    halves = (rng.standard_normal((nblocks, heads // 2)) * 0.05).astype(np.float16)
    blocks[:, :heads] = halves.view(np.uint8)
    return blocks.reshape(rows, cols // 32 * size)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_map_onto_the_layouts_without_loss(kind: str) -> None:
    blocks = _random_blocks(48, 96, kind, np.random.default_rng(0))
    want = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind]).reshape(48, 96)
    parts = {k: torch.from_numpy(v) for k, v in read_quantized(blocks, kind, (48, 96)).items()}
    weight = QuantizedWeight.of(parts["qweight"], parts["scales"], parts.get("zeros"))
    assert weight.kind == ("int8" if kind == "Q8_0" else "int4") and weight.group_size == 32
    np.testing.assert_array_equal(weight.dequantize().numpy(), want)  # bitwise: the file's own numbers
    with pytest.raises(ValueError, match=r"\(48, 96\) needs \d+ bytes"):
        read_quantized(blocks[:, :-1], kind, (48, 96))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_gguf_conversion_keeps_weights_quantized_and_unpermuted(tmp_path: Path, bpe: Tokenizer, qtype: Q) -> None:
    path, _ = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", qtype, tokenizer=bpe)
    dense = load_file(
        str(convert_gguf(path, tmp_path / "dense", progress=False, keep_quantized=False) / "model.safetensors")
    )
    kept = load_file(str(convert_gguf(path, tmp_path / "kept", progress=False) / "model.safetensors"))
    quantized = {n.removesuffix(".qweight") for n in kept if n.endswith(".qweight")}
    assert quantized == {n.removesuffix(".weight") for n, t in dense.items() if t.dim() == 2}
    for module in quantized:
        w = QuantizedWeight.of(kept[f"{module}.qweight"], kept[f"{module}.scales"], kept.get(f"{module}.zeros"))
        torch.testing.assert_close(w.dequantize(), dense[f"{module}.weight"], rtol=0, atol=0, msg=module)
    assert all(torch.equal(kept[n], t) for n, t in dense.items() if t.dim() == 1)


@pytest.mark.parametrize("tie", [False, True])
def test_quantized_gguf_model_runs_on_the_file_numbers(tmp_path: Path, bpe: Tokenizer, tie: bool) -> None:
    path, _ = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", Q.Q4_1, tie=tie, tokenizer=bpe)
    out = convert_gguf(path, tmp_path / "hf", progress=False)
    model = load_model(out, dtype="float32", attention_backend="torch")
    reference = load_model(out, dtype="float32", attention_backend="torch", quantization="none")
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, QuantLinear)
    assert (model.lm_head is None) is tie and (tie or isinstance(model.lm_head, QuantLinear))
    assert not any(isinstance(m, QuantLinear | QuantEmbedding) for m in reference.modules())
    if native.available():  # weights once: the kernel's tiled layout is the only copy, the lookup reads it
        assert all(m.qweight is None and m.cpu_matmul.tiled for m in model.modules() if isinstance(m, QuantLinear))
        assert not any(name.endswith((".qweight", ".scales", ".zeros")) for name in model.state_dict())
    # The embedding rows are the file's numbers exactly; the matmuls differ only by bfloat16 rounding.
    ids = torch.arange(5, 40)
    torch.testing.assert_close(model.model.embed_tokens(ids), reference.model.embed_tokens(ids), rtol=0, atol=0)
    tokens = [5, 9, 17, 3, 44, 8, 21, 60]
    got, want = _logits(model, tokens), _logits(reference, tokens)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() < 0.05 * want.abs().max(), (got - want).abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75


def test_quantize_int8_and_int4_error_bounds() -> None:
    w = torch.randn(40, 256, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 3, 40)[:, None]
    q8 = quantize_int8(w)
    assert q8.kind == "int8" and q8.scales.shape == (40,) and q8.group_size == 256
    assert bool(((q8.dequantize() - w).abs() <= q8.scales[:, None] / 2 + 1e-6).all())
    q4 = quantize_int4(w)
    assert q4.kind == "int4" and q4.group_size == 128 and q4.scales.shape == (40, 2)
    bound = q4.scales.repeat_interleave(128, dim=1) / 2 + 1e-6
    assert bool(((q4.dequantize() - w).abs() <= bound).all())
    assert quantize_int4(w[:, :96]).group_size == 32
    const = quantize_int4(torch.full((2, 64), 0.7))  # a constant group: no division by zero
    torch.testing.assert_close(const.dequantize(), torch.full((2, 64), 0.7))
    with pytest.raises(ValueError, match="group size dividing K = 48"):
        quantize_int4(torch.randn(2, 48))


def test_layout_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="int4 needs scales and zeros"):
        QuantizedWeight.of(torch.zeros(4, 16, dtype=torch.uint8), torch.ones(4, 1))
    with pytest.raises(ValueError, match="int8 weights carry no zeros"):
        QuantizedWeight.of(torch.zeros(4, 32, dtype=torch.int8), torch.ones(4), torch.ones(4))
    with pytest.raises(ValueError, match="groups per row do not divide"):
        QuantizedWeight.of(torch.zeros(4, 32, dtype=torch.int8), torch.ones(4, 3))
    with pytest.raises(ValueError, match="int8 .* or uint8"):
        QuantizedWeight.of(torch.zeros(4, 32, dtype=torch.int32), torch.ones(4))


def _kernel_reference(run: CpuQuantMatmul, weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
    """The CPU path's documented math in float64: the kernel's activation rounding, its scales (as
    stored for the native kernel, bfloat16-rounded for torch's)."""
    scales = weight.scales if weight.scales.dim() == 2 else weight.scales[:, None]
    zeros = weight.zeros
    if run.kernel == "torch":
        scales, zeros = scales.bfloat16(), None if zeros is None else zeros.bfloat16()
    w = QuantizedWeight(weight.qweight, scales.float(), None if zeros is None else zeros.float())
    return F.linear(run.rounded_activations(x).double(), w.dequantize(torch.float64))


@pytest.mark.parametrize("path", [*kernel_paths(), "torch"])
@pytest.mark.parametrize("layout", ["int4", "int4-gguf", "int8-channel", "int8-group"])
@pytest.mark.parametrize("rows", [1, 7, 19, DENSE_ROWS + 5])
def test_cpu_matmul_matches_its_reference(path: str, layout: str, rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every instruction-set path of the native kernel this CPU runs, and torch's kernels, against the
    same reference. GGUF-like layouts (float16 scales, Q4_1's zero = minimum + 8 * scale) take the
    native kernel's float16 scale path; the others keep float32 scales."""
    kernel = "torch" if path == "torch" else "native"
    if kernel == "native":
        use_kernel_path(path, monkeypatch)
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 128, generator=g)
    if layout == "int4":
        weight = quantize_int4(w, group_size=32)
    elif layout == "int4-gguf":  # as GGUF Q4_1: float16 scale d and minimum m per 32, W = q * d + m
        d, m = (torch.randn(96, 4, generator=g) * 0.02).half().float(), (torch.randn(96, 4, generator=g)).half().float()
        q = torch.randint(0, 16, (96, 64), generator=g, dtype=torch.uint8) | (
            torch.randint(0, 16, (96, 64), generator=g, dtype=torch.uint8) << 4
        )
        weight = QuantizedWeight.of(q, d, m + 8 * d)
    elif layout == "int8-channel":
        weight = quantize_int8(w)
    else:  # as GGUF Q8_0: int8 with a float16 scale per 32, -128 included
        scales = (torch.rand(96, 4, generator=g) * 0.02 + 0.001).half().float()
        weight = QuantizedWeight.of(torch.randint(-128, 128, (96, 128), generator=g, dtype=torch.int8), scales)
    x = torch.randn(rows, 128, generator=g)
    run = CpuQuantMatmul(weight, kernel=kernel)
    if kernel == "native":
        assert run.tiled is not None
        assert run.tiled[1].dtype == (torch.float16 if layout in ("int4-gguf", "int8-group") else torch.float32)
    got = run(x)
    want = _kernel_reference(run, weight, x)
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    if kernel == "native":  # float32 sums of the same products
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    else:  # bfloat16 outputs (two planes for int8-group): a few bfloat16 ulps of the largest output
        torch.testing.assert_close(got.double(), want, rtol=2**-6, atol=2**-6 * float(want.abs().max()))
    exact = F.linear(x, weight.dequantize())
    assert (got - exact).abs().max() < 0.02 * exact.abs().max()  # the rounding stays small against the math
    if kernel == "native":  # the tiled bytes are the only copy: they give back the weight, whole or by rows
        ids = torch.tensor([95, 0, 8, 7, 8])
        for rebuilt, want_w in ((run.weight(), weight), (run.weight(ids), _rows(weight, ids))):
            assert torch.equal(rebuilt.qweight, want_w.qweight)
            assert torch.equal(rebuilt.dequantize(), want_w.dequantize())


def _rows(weight: QuantizedWeight, ids: torch.Tensor) -> QuantizedWeight:
    zeros = None if weight.zeros is None else weight.zeros[ids]
    return QuantizedWeight(weight.qweight[ids], weight.scales[ids], zeros)


@pytest.mark.parametrize("path", kernel_paths())
def test_native_kernel_is_exact_on_integer_activations(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Activations that the int8 round trip keeps exactly (integers up to 127 per block, 127 present):
    the kernel's result, on each instruction-set path, equals x @ W.T of the exact dequantised weight
    to float32 rounding (int8 weights include -128, the one value whose sign trick needs care)."""
    use_kernel_path(path, monkeypatch)
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-127, 128, (9, 256), generator=g).float()
    x.view(9, 8, 32)[:, :, 0] = 127.0
    assert torch.equal(native.quantize_activations(x), x)
    for weight in (
        quantize_int4(torch.randn(48, 256, generator=g), group_size=64),
        quantize_int8(torch.randn(48, 256)),
        QuantizedWeight.of(torch.randint(-128, 128, (48, 256), generator=g, dtype=torch.int8), torch.rand(48, 8) + 0.5),
    ):
        got = CpuQuantMatmul(weight, kernel="native")(x)
        want = F.linear(x.double(), weight.dequantize(torch.float64))
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("path", kernel_paths())
def test_the_kernels_activations_are_quantize_activations_bit_for_bit(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On random activations the kernel's int8 round trip of x is `quantize_activations(x)` bit for bit, on each
    instruction-set path: an int8 identity weight with unit scales gives back each activation as the kernel
    quantized it (one product per output; every other block's integer sum is exactly zero). Rows of 3 blocks at
    1 to 19 rows, so the kernel's groups of 8 blocks straddle rows and the last group is part-filled; rows
    scaled from 1e-3 to 1e3; a block of zeros (d = 0) and a block holding one value."""
    use_kernel_path(path, monkeypatch)
    g = torch.Generator().manual_seed(11)
    k = 96
    weight = native.tile_int8(torch.eye(k, dtype=torch.int8), torch.ones(k, k // 32))
    for rows in (1, 2, 3, 5, 8, 19):
        x = torch.randn(rows, k, generator=g) * torch.logspace(-3, 3, rows).unsqueeze(1)
        x[0, 32:64] = 0.0
        if rows > 2:
            x[2, :32] = 0.0
            x[2, 5] = -7.25
        want = native.quantize_activations(x)
        assert not torch.equal(want, x)  # the round trip changes random activations: the test can tell
        assert torch.equal(native.int8_gemm(x, weight), want), rows


_ROW_COUNTS = [*range(1, 10), 16, 17, 35]  # every register tile of rows (1-4), whole AMX tiles of 16 and after


def _weights_for_paths(g: torch.Generator) -> dict[str, tuple[torch.Tensor, ...]]:
    """Tiled weights of every kind the kernel takes: int4 with GGUF's float16 scales and with float32 ones,
    int8 per group (-128 included)."""
    gguf_like = quantize_int4(torch.randn(48, 256, generator=g), group_size=32)
    scales = gguf_like.scales.half().float()
    weights = {
        "int4-gguf": native.tile_int4(
            gguf_like.qweight, scales, (gguf_like.zeros - 8 * scales).half().float() + 8 * scales
        ),
        "int4": native.tile_int4(*quantize_int4(torch.randn(48, 256, generator=g), group_size=64).tensors()),
        "int8": native.tile_int8(
            torch.randint(-128, 128, (48, 256), generator=g, dtype=torch.int8), torch.rand(48, 8, generator=g) + 0.5
        ),
    }
    assert weights["int4-gguf"][1].dtype == torch.float16 and weights["int4"][1].dtype == torch.float32
    return weights


def _gemms(weights: dict[str, tuple[torch.Tensor, ...]], x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each weight's GEMM of x's first m rows, for every m of `_ROW_COUNTS`, concatenated."""
    return {
        name: torch.cat([(native.int4_gemm if len(w) == 3 else native.int8_gemm)(x[:m], w) for m in _ROW_COUNTS])
        for name, w in weights.items()
    }


def test_every_path_gives_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The instruction-set paths sum the same exact integer products and do the same float operations per
    column in the same order (csrc/wq_gemm.c), so on random activations (not the integers the round trip
    keeps) they agree bit for bit: int4 with GGUF's float16 scales and with float32 ones, int8 per group,
    at 1 to 9 rows (every register tile of rows) and at 16, 17 and 35 (AMX's whole tiles of 16 rows and
    the rows after them). Needs two paths this CPU runs."""
    runnable = [p for p in kernel_paths() if not isa.missing(isa.PATHS[p])]
    if len(runnable) < 2:
        pytest.skip(f"this CPU runs only {runnable} of the kernel paths {kernel_paths()}: nothing to compare")
    g = torch.Generator().manual_seed(5)
    weights = _weights_for_paths(g)
    x = torch.randn(35, 256, generator=g) * 3
    results: dict[str, dict[str, torch.Tensor]] = {}
    for path in runnable:
        use_kernel_path(path, monkeypatch)
        results[path] = _gemms(weights, x)
    first, *others = runnable
    for path in others:
        for name in weights:
            assert torch.equal(results[path][name], results[first][name]), (path, name)


def test_the_amx_path_gives_avx512_vnnis_bits_with_its_tile_operations_emulated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The `avx512_amx` path's source built with its tile operations done in C as Intel's manual defines
    them (csrc/amx.h, HX_AMX_EMULATE: each operation's shapes checked against the loaded configuration),
    so its tiling runs on a CPU without AMX: at 16 rows or more (whole tiles of 16 by TDPBSUD / TDPBSSD,
    the rest by vpdpbusd) it gives the `avx512_vnni` path's results bit for bit. On a CPU with AMX,
    test_every_path_gives_the_same_bits runs the real instructions."""
    use_kernel_path("avx512_vnni", monkeypatch)
    g = torch.Generator().manual_seed(7)
    weights = _weights_for_paths(g)
    x = torch.randn(35, 256, generator=g) * 3
    want = _gemms(weights, x)
    lib = use_emulated_amx(monkeypatch)
    before = lib.helexa_amx_emulated_products()  # the count is the process's: other tests ran the library
    got = _gemms(weights, x)
    # 3 weights x 3 column tiles x K/32 blocks x (16 + 16 + 32 rows) / 16
    assert lib.helexa_amx_emulated_products() - before == 3 * 3 * 8 * 4
    for name in weights:
        assert torch.equal(got[name], want[name]), name


def test_an_amx_path_whose_tile_state_is_not_granted_is_refused_with_the_reason() -> None:
    """A path that needs AMX loads only once its library has been granted the tile state: here a library
    built without AMX (whose grant answers 'not an AMX build') stands for Linux saying no."""
    avx2 = isa.PATHS["avx2"]
    if isa.missing(avx2):
        pytest.skip(f"this CPU lacks {isa.missing(avx2)}: no library to load")
    ungranted = isa.KernelPath("amx_ungranted", avx2.compile_flags, avx2.cpu_flags | {"amx_tile", "amx_int8"})
    lib, why = native.load_path(ungranted)
    assert lib is None and why.startswith("Linux did not grant the AMX tile state"), why
    lib, why = native.load_path(avx2)  # the same library, for a path that needs no AMX, loads
    assert lib is not None and why == ""


def test_the_tiled_layout_gives_back_the_weight_and_any_of_its_rows() -> None:
    """`native.untile` rebuilds the canonical weight from the kernel's tiled bytes (the only resident copy of
    a quantized table: the embedding looks its rows up there): the whole weight dequantizes to the same
    numbers, and rows asked for in any order, repeated, in every one of a tile's 16 columns, come back as
    those rows of it, bit for bit."""
    g = torch.Generator().manual_seed(11)
    int4 = quantize_int4(torch.randn(48, 256, generator=g), group_size=32)
    int8 = QuantizedWeight.of(
        torch.randint(-128, 128, (48, 256), generator=g, dtype=torch.int8), torch.rand(48, 1, generator=g) + 0.5
    )
    # every column of a tile (the row mod 16), some twice, some in two tiles
    rows = torch.tensor([47, 0, 5, 5, 12, 3, 44, 9, 30, 7, 1, 38, 6, 2, 4, 21, 8, 10, 11, 13, 14, 15, 31, 29])
    for weight, tiled in (
        (int4, native.tile_int4(int4.qweight, int4.scales, int4.zeros)),
        (int8, native.tile_int8(int8.qweight, int8.scales)),
    ):
        whole = native.untile(tiled)
        assert torch.equal(whole.dequantize(torch.float64), weight.dequantize(torch.float64))
        some = native.untile(tiled, rows)
        assert torch.equal(some.qweight, whole.qweight[rows])
        assert torch.equal(some.scales, whole.scales[rows])
        assert (some.zeros is None) == (whole.zeros is None)
        if some.zeros is not None:
            assert torch.equal(some.zeros, whole.zeros[rows])
        assert torch.equal(some.dequantize(), weight.dequantize()[rows])


@pytest.mark.parametrize("path", kernel_paths())
def test_looked_up_rows_are_the_dequantized_weight_s_rows(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`native.dequantize_rows` (the embedding lookup over the tiled bytes) gives, bit for bit, the rows of
    the canonical weight dequantized by torch: int4 with float32 scales and with GGUF Q4_1's float16 scale
    and minimum, int8 per channel and per group of 32 (float16 scales, -128 included); rows in every
    column of a tile, in any order, repeated. An id outside the table is an IndexError."""
    use_kernel_path(path, monkeypatch)
    g = torch.Generator().manual_seed(12)
    d = (torch.randn(48, 8, generator=g) * 0.02).half().float()
    m = torch.randn(48, 8, generator=g).half().float()
    nibbles = torch.randint(0, 256, (48, 128), generator=g, dtype=torch.uint8)
    int8 = torch.randint(-128, 128, (48, 256), generator=g, dtype=torch.int8)
    int8[0, 0] = -128
    weights = {
        "int4": quantize_int4(torch.randn(48, 256, generator=g), group_size=64),
        "int4-gguf": QuantizedWeight.of(nibbles, d, m + 8 * d),
        "int8-channel": QuantizedWeight.of(int8, torch.rand(48, generator=g) + 0.5),
        "int8-group": QuantizedWeight.of(int8, (torch.rand(48, 8, generator=g) * 0.02 + 0.001).half().float()),
    }
    # every column of a tile (the row mod 16), some twice, some in two tiles
    rows = torch.tensor([47, 0, 5, 5, 12, 3, 44, 9, 30, 7, 1, 38, 6, 2, 4, 21, 8, 10, 11, 13, 14, 15, 31, 29])
    for name, weight in weights.items():
        run = CpuQuantMatmul(weight, kernel="native")
        assert run.tiled is not None
        assert run.tiled[1].dtype == (torch.float16 if name in ("int4-gguf", "int8-group") else torch.float32), name
        want = weight.dequantize(torch.float32)[rows]
        got = native.dequantize_rows(run.tiled, rows)
        assert got.dtype == torch.float32 and torch.equal(got, want), name
        assert torch.equal(native.dequantize_rows(run.tiled, rows[3:4]), want[3:4]), name
        for bad in (48, -1):
            with pytest.raises(IndexError, match=f"row {bad} is out of range"):
                native.dequantize_rows(run.tiled, torch.tensor([2, bad]))


def test_a_quantized_embedding_looks_up_ids_of_any_shape() -> None:
    """QuantEmbedding gives ids.shape + (E,) for ids of any shape, each row the dequantized row of the
    table its CPU execution holds."""
    weight = quantize_int4(torch.randn(64, 128, generator=torch.Generator().manual_seed(5)), group_size=32)
    ids = torch.tensor([[1, 5, 9], [63, 0, 2]])
    embedding = QuantEmbedding(weight, torch.float32)
    embedding.head.prepare()
    got = embedding(ids)
    assert got.shape == (2, 3, 128)
    assert torch.equal(got, embedding.head.cpu_matmul.weight().dequantize()[ids])  # type: ignore[union-attr]
    assert torch.equal(embedding(ids[1]), got[1])


def _poisoned_gemm(tiled: tuple[torch.Tensor, ...], x: torch.Tensor) -> torch.Tensor:
    """The kernel's GEMM of x by a tiled weight, into an output filled with NaN beforehand (a tile no thread
    computed stays NaN)."""
    out = torch.full((x.shape[0], tiled[0].shape[0] * 16), float("nan"))
    got = (native.int4_gemm if len(tiled) == 3 else native.int8_gemm)(x, tiled, out=out)
    assert got is out
    return out


@pytest.mark.parametrize("path", kernel_paths())
def test_a_gemm_gives_the_same_bits_however_its_threads_share_its_tiles(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread that has finished its own run of tiles takes the rest of another's (csrc/wq_gemm.c, take_tiles), so
    which thread computes a tile changes from call to call. Each tile is still computed once and the same way:
    with 2, 3 and 5 threads (more than this machine's cores, so they are preempted and take from each other's
    runs), over many calls, every output (NaN before the call) equals the one-thread result bit for bit, for
    weights of 1, 7 and 40 tiles of 16 columns (fewer tiles than threads too), int4 and int8, at 1 and 5 rows."""
    use_kernel_path(path, monkeypatch)
    g = torch.Generator().manual_seed(11)
    weights = []
    for tiles in (1, 7, 40):
        w = torch.randn(16 * tiles, 256, generator=g)
        weights.append(native.tile_int4(*quantize_int4(w, group_size=32).tensors()))
        weights.append(native.tile_int8(*quantize_int8(w).tensors()))
    xs = [torch.randn(rows, 256, generator=g) for rows in (1, 5)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = [[_poisoned_gemm(w, x) for x in xs] for w in weights]
        assert not any(t.isnan().any() for row in want for t in row)
        for n in (2, 3, 5):
            torch.set_num_threads(n)
            for _ in range(20):
                for w, outs in zip(weights, want):
                    for x, out in zip(xs, outs):
                        assert torch.equal(_poisoned_gemm(w, x), out), (n, w[0].shape, x.shape)
    finally:
        torch.set_num_threads(threads)


_FEWER_THREADS = """
import sys, torch
from helexa.model.quant import native, quantize_int4
torch.manual_seed(0)
tiled = native.tile_int4(*quantize_int4(torch.randn(16 * 9, 256), group_size=32).tensors())
x = torch.randn(3, 256)
torch.set_num_threads(1)
want = native.int4_gemm(x, tiled)
native.library().helexa_set_threads(4)  # four runs of tiles, and a team of one (OMP_THREAD_LIMIT=1)
got = native.int4_gemm(x, tiled)
sys.exit(0 if torch.equal(got, want) else "a team smaller than its runs left tiles uncomputed")
"""


def test_a_team_smaller_than_the_threads_asked_for_computes_every_tile() -> None:
    """OpenMP may give a GEMM fewer threads than it asked for (OMP_THREAD_LIMIT, a nested region): the runs of
    tiles with no thread of their own are taken by the others, so the result is whole and the same."""
    if not native.available():
        pytest.skip(f"helexa's CPU kernel is unavailable here: {native.unavailable_reason()}")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_THREAD_LIMIT": "1"}
    done = subprocess.run([sys.executable, "-c", _FEWER_THREADS], capture_output=True, text=True, timeout=120,
                          cwd=root, env=env)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


_OUT_OF_MEMORY = """
import resource, sys, torch
from helexa.model.quant import native, quantize_int4
torch.set_num_threads(2)
w = quantize_int4(torch.randn(16, 1024), group_size=32)
tiled = native.tile_int4(w.qweight, w.scales, w.zeros)
native.int4_gemm(torch.randn(4, 1024), tiled)  # the library and its threads, before the limit
x = torch.empty(100_000, 1024)  # 400 MB of address space; the kernel's int8 copy of it needs 140 MB more
vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (64 << 20), resource.RLIM_INFINITY))
try:
    native.int4_gemm(x, tiled)
except MemoryError as exc:
    print("MemoryError:", exc)
    sys.exit(0)
sys.exit("no MemoryError")
"""


def test_the_kernel_says_when_it_cannot_allocate_its_activations() -> None:
    """A matmul whose int8 activation buffer cannot be allocated raises MemoryError (never a crash or a
    result it did not compute): run in a process whose address space leaves no room for it."""
    if not native.available():
        pytest.skip(f"helexa's CPU kernel is unavailable here: {native.unavailable_reason()}")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _OUT_OF_MEMORY], capture_output=True, text=True, timeout=120, cwd=root)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "could not allocate its activation buffer (100000 x 1024)" in done.stdout


def test_native_kernel_checks_its_inputs() -> None:
    if not native.available():
        pytest.skip(f"helexa's CPU kernel is unavailable here: {native.unavailable_reason()}")
    weight = quantize_int4(torch.randn(16, 64), group_size=32)
    tiled = native.tile_int4(weight.qweight, weight.scales, weight.zeros)
    with pytest.raises(ValueError, match="float32"):
        native.int4_gemm(torch.randn(2, 64, dtype=torch.float64), tiled)
    with pytest.raises(ValueError, match=r"\(M, 64\)"):
        native.int4_gemm(torch.randn(2, 32), tiled)
    with pytest.raises(ValueError, match=r"out must be a contiguous CPU float32 \(2, 16\)"):
        native.int4_gemm(torch.randn(2, 64), tiled, out=torch.empty(2, 17))
    with pytest.raises(ValueError, match="out must be"):
        native.int4_gemm(torch.randn(2, 64), tiled, out=torch.empty(16, 2).t())
    assert not native.supports(8, 64, 32) and not native.supports(24, 64, 32) and not native.supports(16, 48, 16)
    assert native.supports(16, 64, 32) and native.supports(48, 64, 32)
    assert cpu_kernel(quantize_int4(torch.randn(8, 64), group_size=32)) == "torch"  # N % 16 != 0
    assert cpu_kernel(quantize_int4(torch.randn(16, 64), group_size=32)) == "native"
    with pytest.raises(ValueError, match="unknown CPU quant kernel"):
        CpuQuantMatmul(weight, kernel="avx9")


def test_the_kernel_path_is_the_best_the_cpu_runs_and_never_one_it_lacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Dispatch by what the CPU reports: `auto` takes the best path it runs; a path it lacks, or an
    unknown name, is refused with the reason (the torch kernels serve), never run; the loader logs the
    path a quantized model runs on."""
    avx2_only = frozenset({"avx2", "fma", "f16c", "sse4_2"})
    monkeypatch.setattr(isa, "cpu_flags", lambda: avx2_only)
    assert isa.candidates("auto") == ([isa.PATHS["avx2"]], "")
    paths, why = isa.candidates("avx512_vnni")
    assert (
        paths == []
        and why == "HELEXA_CPU_KERNELS=avx512_vnni but the CPU lacks ['avx512_vnni', 'avx512bw', 'avx512f', 'avx512vl']"
    )
    assert isa.candidates("avx9")[1] == "HELEXA_CPU_KERNELS='avx9' is not one of auto, avx2, avx512_vnni, avx512_amx"
    amx = avx2_only | isa.PATHS["avx512_amx"].cpu_flags
    monkeypatch.setattr(isa, "cpu_flags", lambda: amx)
    assert [p.name for p in isa.candidates("auto")[0]] == ["avx512_amx", "avx512_vnni", "avx2"]
    monkeypatch.setattr(isa, "cpu_flags", lambda: frozenset({"sse4_2"}))
    assert isa.candidates("auto") == ([], "the CPU lacks ['avx2', 'f16c', 'fma']")
    monkeypatch.undo()

    runnable, _ = isa.candidates("auto")
    if not runnable or not native.available():
        pytest.skip(f"helexa's CPU kernel is unavailable here: {native.unavailable_reason()}")
    # the best this CPU runs (an AMX path whose tile state Linux refused, or that failed its check against
    # avx512_vnni, is passed over, with the reason); chosen automatically, a checked path's check is timed
    chosen = next(p.name for p in runnable if native._load(p.name, True)[0] is not None)
    assert native.kernel_path() == chosen
    assert set(native.passed_over()) == {p.name for p in runnable[: [p.name for p in runnable].index(chosen)]}
    monkeypatch.setenv("HELEXA_CPU_KERNELS", "avx9")
    assert not native.available() and "not one of" in native.unavailable_reason() and native.kernel_path() == "torch"
    assert cpu_kernel() == "torch"
    monkeypatch.setenv("HELEXA_CPU_KERNELS", "auto")
    with caplog.at_level("INFO", logger="helexa"):
        load_model(make_tiny_model(tmp_path, "llama"), dtype="float32", attention_backend="torch", quantization="int4")
    assert f"model: cpu kernels {native.describe_path()}\n" in caplog.text


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantization_at_load_for_every_architecture(tmp_path: Path, arch: str, method: str) -> None:
    path = make_tiny_model(tmp_path, arch, intermediate_size=128)
    model = load_model(path, dtype="float32", attention_backend="torch", quantization=method)
    dense = load_model(path, dtype="float32", attention_backend="torch")
    linears = [m for n, m in model.named_modules() if n.startswith("model.layers") and isinstance(m, QuantLinear)]
    assert len(linears) == 4 * model.config.num_hidden_layers
    assert all(m.weight_q.kind == method for m in linears)
    assert isinstance(model.model.embed_tokens, torch.nn.Embedding)  # the embedding and head stay as stored
    qkv = model.model.layers[0].self_attn.qkv_proj
    if model.config.qkv_bias:
        assert qkv.bias is not None and torch.equal(qkv.bias, dense.model.layers[0].self_attn.qkv_proj.bias)
    tokens = [5, 9, 17, 3, 44, 8, 21, 60, 2, 11]
    got, want = _logits(model, tokens), _logits(dense, tokens)
    tolerance = 0.05 if method == "int8" else 0.25
    assert torch.isfinite(got).all() and (got - want).abs().max() < tolerance * want.abs().max()


def test_quantization_none_and_bad_values(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path, "llama")
    model = load_model(path, dtype="float32", attention_backend="torch", quantization="none")
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    with pytest.raises(ValueError, match=r"unknown quantization 'int3'.*'int8', 'int4'"):
        load_model(path, attention_backend="torch", quantization="int3")
