"""TensorFile (positioned reads of a safetensors file, never mapped) against the safetensors library,
and the loader's module-by-module reading that lets a quantized module's tiled layout replace its
read tensors before the next module is read."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from helexa.model.loader import load_model
from helexa.model.quant import native
from helexa.model.quant.linear import QuantLinear
from helexa.model.weights.gguf import convert_gguf
from helexa.model.weights.tensor_file import TensorFile
from tests.support.gguf import Q, write_tiny_gguf

TENSORS = {
    "f32": torch.randn(7, 5),
    "f16": torch.randn(3, 9).half(),
    "bf16": torch.randn(4, 4).bfloat16(),
    "i8": torch.randint(-128, 128, (6, 32), dtype=torch.int8),
    "u8": torch.randint(0, 256, (5, 16), dtype=torch.uint8),
    "i64": torch.arange(11),
    "scalar": torch.tensor(3.5),
    "empty": torch.empty(0, 4),
    "flag": torch.tensor([True, False, True]),
}


@pytest.fixture(scope="module")
def st_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tensor_file") / "t.safetensors"
    save_file(TENSORS, str(path), metadata={"format": "pt"})
    return path


def test_every_tensor_reads_as_the_safetensors_library_reads_it(st_file: Path) -> None:
    with TensorFile(st_file) as f, safe_open(str(st_file), framework="pt") as ref:
        assert sorted(f.keys()) == sorted(ref.keys()) == sorted(TENSORS)
        for name in TENSORS:
            got = f.read(name)
            assert got.dtype == TENSORS[name].dtype and got.shape == TENSORS[name].shape, name
            assert torch.equal(got, ref.get_tensor(name)), name
            assert got.is_contiguous()


def test_row_and_column_slices_read_only_their_part(st_file: Path) -> None:
    with TensorFile(st_file) as f:
        for name in ("f32", "f16", "bf16", "i8", "u8"):
            full = TENSORS[name]
            assert torch.equal(f.read(name, (0, 1, 3)), full[1:3]), name
            assert torch.equal(f.read(name, (1, 2, 4)), full[:, 2:4]), name
            assert f.read(name, (1, 2, 4)).is_contiguous()
            assert f.read(name, (0, 2, 2)).shape == (0, full.shape[1])
        with pytest.raises(ValueError, match="slice"):
            f.read("f32", (0, 3, 8))  # past the 7 rows
        assert torch.equal(f.read("i64", (0, 3, 7)), TENSORS["i64"][3:7])  # rows of a 1-D tensor (a bias)
        with pytest.raises(ValueError, match="slice"):
            f.read("i64", (1, 0, 1))  # no columns
        with pytest.raises(ValueError, match="slice"):
            f.read("scalar", (0, 0, 1))


def test_a_truncated_file_is_refused_with_its_name(st_file: Path, tmp_path: Path) -> None:
    data = st_file.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-8])
    with pytest.raises(ValueError, match="cut.safetensors.*do not fit"):
        TensorFile(cut)
    short = tmp_path / "short.safetensors"
    short.write_bytes(data[:5])
    with pytest.raises(ValueError, match="not a safetensors file"):
        TensorFile(short)


def test_a_bad_header_is_refused(tmp_path: Path) -> None:
    def write(header: object) -> Path:
        raw = json.dumps(header).encode()
        path = tmp_path / "bad.safetensors"
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(16))
        return path

    with pytest.raises(ValueError, match="bad header entry"):
        TensorFile(write({"x": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 16]}}))
    with pytest.raises(ValueError, match="do not fit"):
        TensorFile(write({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}))  # 16 bytes needed
    with pytest.raises(ValueError, match="header length"):
        (tmp_path / "huge.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + bytes(16))
        TensorFile(tmp_path / "huge.safetensors")


def _owner(checkpoint_module: str) -> str:
    """The model module a checkpoint module fills (q/k/v -> qkv, gate/up -> gate_up)."""
    for parts, fused in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj")):
        for part in parts:
            if checkpoint_module.endswith(part):
                return checkpoint_module.removesuffix(part) + fused
    return checkpoint_module


@pytest.mark.skipif(not native.available(), reason=f"native kernel unavailable: {native.unavailable_reason()}")
def test_each_quantized_module_is_tiled_before_the_next_is_read(tmp_path: Path, monkeypatch) -> None:
    """Reading follows modules, and a quantized module is prepared as soon as its parts are read:
    between two preparations, the quantized parts read all belong to the one module prepared next,
    so the checkpoint's canonical tensors are never resident together."""
    gguf_path, _ = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", Q.Q4_1)
    model_dir = convert_gguf(gguf_path, tmp_path / "hf", progress=False)
    events: list[tuple[str, str]] = []  # ("read", model module of a quantized part) / ("tiled", "")
    real_read, real_prepare = TensorFile.read, QuantLinear.prepare_from

    def read(self, name, part=None):
        module, _, leaf = name.rpartition(".")
        if leaf in ("qweight", "scales", "zeros"):
            events.append(("read", _owner(module)))
        return real_read(self, name, part)

    def prepare_from(self, weight):
        done = real_prepare(self, weight)
        events.append(("tiled", str(done)))
        return done

    monkeypatch.setattr(TensorFile, "read", read)
    monkeypatch.setattr(QuantLinear, "prepare_from", prepare_from)
    model = load_model(model_dir, dtype="float32", quantization="auto")
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert quantized and all(m.qweight is None and m.cpu_matmul is not None for m in quantized)
    assert [done for kind, done in events if kind == "tiled"] == ["True"] * len(quantized)
    since: set[str] = set()
    for kind, what in events:
        if kind == "read":
            since.add(what)
        else:
            assert len(since) == 1, (since, events)
            since = set()
    assert not since
